"""``SequenceParquetDataModule``: next-item pretraining batches streamed from a prepared directory, per rank.

The examples are those of ``SequenceFileDataModule`` (the same leave-one-out split per user, the same
``SequenceBatch``es, the input cut to the newest ``max_length`` items); what differs is how the work
is cut between ranks and ordered:

- Ranks: rank ``r`` of ``W`` reads only the users ``rank_range(num_users, r, W)`` of the global user
  order (files, then rows), located from ``metadata.json`` (``reader.py``).
- Training: each rank makes batches of ``global_batch_size / W`` of its own users' examples. Every
  epoch its row groups come in a new order (from ``seed``, the epoch and the rank) through a buffer
  of ``shuffle_buffer`` examples, shuffled at each refill; with ``num_workers > 0`` the row groups are
  dealt to the workers in turn. Every rank runs the same number of batches per epoch, computed from
  the metadata: the fewest any rank is sure to fill (a rank's last incomplete batch, and the
  examples a worker has left over, wait for the next epoch's different order). Negatives as in
  ``SequenceFileDataModule``: ``num_negatives`` uniform rows per local batch, spread over its
  examples; drawn in turn from one generator per epoch, rank and worker (seeded by ``seed``), so
  the pools differ from the text path's, which seeds one generator per batch.
- Validation and test: every user with >= 3 events, exactly once over all ranks, in user order.
  Every rank runs the same number ``K`` of batches, the most any rank needs for at most
  ``global_batch_size / W`` examples per batch (from the metadata), and spreads its own examples
  evenly over them, so no rank has an empty batch (which would make every rank skip the step and
  lose the others' users). The rank reads the row groups it shares with its neighbours once at
  the start to count their examples exactly.
- Predict: every user, once, with ``predict_view="full"`` (the default): the input is the whole
  history, what a serving system sees, and the seen ids are every item of it; ``"test"``: the test
  view (users with >= 3 events, the last item held out). Predict batches are
  ``UserSequenceBatch``es: they carry ``user_ids`` (the ids of ``user_id``, on the CPU).
- Timestamps: where the directory has a ``timestamps`` column (``metadata.has_timestamps``: ``prepare``
  with a time column) and ``timestamps=True``, every batch carries each input item's time in
  ``SequenceBatch.timestamps`` (cut and shuffled with the items), which ``SequencePretrainer`` passes
  to its encoder (``HSTUEncoder``'s time buckets read them); otherwise ``timestamps`` is ``None``.
"""

from __future__ import annotations

import logging
from typing import Literal

from torch.utils.data import DataLoader

from lightning_recsys.data.module import RankSlicedDataModule, Split
from lightning_recsys.data.parquet.contract import PreparedMetadata
from lightning_recsys.data.parquet.reader import ByteCounter, PreparedReader, Segment, open_prepared, plan_rank
from lightning_recsys.data.parquet.streams import (
    EpochLoader,
    EvaluationStream,
    TrainingLoader,
    TrainingStream,
    View,
    chunk_examples,
    evaluation_batches,
    example_bounds,
)
from lightning_recsys.data.ranks import check_divisible
from lightning_recsys.data.sequences.module import NumNegatives, check_int

log = logging.getLogger(__name__)

PredictView = Literal["full", "test"]


class SequenceParquetDataModule(RankSlicedDataModule):
    """Pretraining ``SequenceBatch``es from a prepared directory (``lightning-recsys prepare``); see the module docstring.

    Args:
        path: the prepared directory (``metadata.json``, ``items.parquet``, ``users/``).
        max_length: the newest this many items of a sequence form an example's input.
        num_negatives: sampled negatives per local training batch, uniform over the item table's rows
            with replacement; ``"all"``: every row (the full softmax).
        global_batch_size: examples per step over all ranks; a multiple of the world size.
        shuffle: training row groups and examples in a new order every epoch.
        seed: the training order and the negatives follow it.
        shuffle_buffer: training examples a rank (each worker) holds to shuffle among, >= 0. Memory grows
            with it (about ``max_length + 1`` item rows per example), not with the data.
        num_workers: ``DataLoader`` worker processes per rank (0: read in the training process).
        prefetch_factor: batches each worker prepares ahead (with ``num_workers > 0``).
        predict_view: ``"full"``: predict from every user's whole history; ``"test"``: the test examples.
        timestamps: read the ``timestamps`` column where the directory has one and put each input item's
            time in the batches (``SequenceBatch.timestamps``); False leaves the column unread (no bytes
            read, batches without times, as for a directory without the column).

    Attributes read from ``metadata.json`` alone (no event is read): ``num_items``, ``num_action_types``,
    ``num_users``, ``num_events``, ``has_timestamps``, ``metadata``.
    """

    def __init__(
        self,
        path: str,
        max_length: int = 50,
        num_negatives: NumNegatives = 3000,
        global_batch_size: int = 128,
        shuffle: bool = True,
        seed: int = 0,
        shuffle_buffer: int = 8192,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        predict_view: PredictView = "full",
        timestamps: bool = True,
    ) -> None:
        super().__init__()
        if not str(path):
            raise ValueError(f"path={path!r} must name a prepared directory (write one with `lightning-recsys prepare`).")
        check_int("max_length", max_length, 1)
        if num_negatives != "all":
            check_int("num_negatives", num_negatives, 0, " or 'all' (every item: the full softmax)")
        check_int("global_batch_size", global_batch_size, 1)
        if not isinstance(shuffle, bool):
            raise ValueError(f"shuffle={shuffle!r} must be true or false.")
        check_int("seed", seed, 0)
        check_int("shuffle_buffer", shuffle_buffer, 0, " (examples held to shuffle among; 0: row-group order only)")
        check_int("num_workers", num_workers, 0)
        check_int("prefetch_factor", prefetch_factor, 1)
        if predict_view not in ("full", "test"):
            raise ValueError(f"predict_view={predict_view!r} must be 'full' (the whole history) or 'test' (the test examples).")
        if not isinstance(timestamps, bool):
            raise ValueError(f"timestamps={timestamps!r} must be true (read the directory's timestamps, if any) or false.")
        self.path, self.max_length, self.num_negatives = str(path), max_length, num_negatives
        self.global_batch_size, self.shuffle, self.seed = global_batch_size, shuffle, seed
        self.shuffle_buffer, self.num_workers, self.prefetch_factor = shuffle_buffer, num_workers, prefetch_factor
        self.predict_view: PredictView = predict_view
        self.timestamps = timestamps
        self._metadata: PreparedMetadata | None = None
        self._exact_counts: dict[tuple[int, int, str], list[int]] = {}
        self.counter = ByteCounter()  # bytes and events read by this process's readers (workers count their own)

    # --- metadata only --------------------------------------------------------------------------------
    @property
    def metadata(self) -> PreparedMetadata:
        if self._metadata is None:
            self._metadata = open_prepared(self.path)
            if self.trainer is None or self.trainer.global_rank == 0:
                self._log_counts(self._metadata)
        return self._metadata

    @property
    def num_items(self) -> int:
        """Rows of the item table (the shared out-of-vocabulary row included)."""
        return self.metadata.num_items

    @property
    def num_action_types(self) -> int:
        """Action types of the ``action`` feature; 0 when the data has none."""
        return self.metadata.num_action_types

    @property
    def has_timestamps(self) -> bool:
        """Whether the batches carry timestamps: the directory has them and ``timestamps`` is True."""
        return self.timestamps and self.metadata.has_timestamps

    @property
    def num_users(self) -> int:
        return self.metadata.num_users

    @property
    def num_events(self) -> int:
        return self.metadata.num_events

    @property
    def bytes_read(self) -> int:
        """Bytes this process read from the user files (workers' reads are counted in the workers)."""
        return self.counter.value

    def setup(self, stage: str | None = None) -> None:
        self.metadata  # noqa: B018 - reads and validates metadata.json only

    def _log_counts(self, meta: PreparedMetadata) -> None:
        shorts = [sum(g.short_users[i] for f in meta.files for g in f.row_groups) for i in range(3)]
        log.info(
            "%s: %d users, %d events, %d item rows; users with 1, 2, 3 events: %d, %d, %d (1: no example; 3: no training "
            "example; 1 and 2: no validation or test example).", self.path, meta.num_users, meta.num_events, meta.num_items, *shorts,
        )

    # --- batches --------------------------------------------------------------------------------------
    def _reader(self, *, with_user_ids: bool) -> PreparedReader:
        return PreparedReader(self.path, self.metadata, with_user_ids=with_user_ids, counter=self.counter, timestamps=self.timestamps)

    def training_batches(self, world_size: int) -> int:
        """Training batches per epoch on every rank: the fewest any rank is sure to fill (see the module docstring)."""
        check_divisible(self.global_batch_size, world_size)
        local = self.global_batch_size // world_size
        workers = max(1, self.num_workers)
        surest = min(sum(example_bounds(s, "train")[0] for s in plan_rank(self.metadata, r, world_size)) for r in range(world_size))
        # Each worker drops its own last incomplete batch: up to one per worker beyond the rank's.
        return max(0, surest // local - (workers - 1))

    def exact_counts(self, rank: int, world_size: int, view: View) -> list[int]:
        """Each of the rank's segments' ``view`` examples: the metadata's for whole row groups, counted for shared ones."""
        key = (rank, world_size, view)
        if key not in self._exact_counts:
            counts, reader = [], None
            for segment in plan_rank(self.metadata, rank, world_size):
                low, high = example_bounds(segment, view)
                if low != high:
                    reader = reader or self._reader(with_user_ids=False)
                    low = len(chunk_examples(reader.read(segment), view)[0])
                counts.append(low)
            if reader is not None:
                reader.close()
            self._exact_counts[key] = counts
        return self._exact_counts[key]

    def evaluation_batches(self, world_size: int, view: View) -> int:
        """Evaluation batches every rank runs for ``view`` (from the metadata's upper bounds of every rank)."""
        local = max(1, self.global_batch_size // world_size)
        uppers = [sum(example_bounds(s, view)[1] for s in plan_rank(self.metadata, r, world_size)) for r in range(world_size)]
        return evaluation_batches(uppers, local)

    def stream(self, split: Split | Literal["predict"], rank: int, world_size: int) -> TrainingStream | EvaluationStream:
        """Rank ``rank``'s dataset of one split (``"predict"``: the ``predict_view``)."""
        check_divisible(self.global_batch_size, world_size)
        segments: list[Segment] = plan_rank(self.metadata, rank, world_size)
        if split == "train":
            batches, local = self.training_batches(world_size), self.global_batch_size // world_size
            low, high = (sum(example_bounds(s, "train")[i] for s in segments) for i in (0, 1))
            log.info(
                "%s rank %d: %d training batches of %d per epoch, %d examples of its %d-%d (the rest wait for another "
                "epoch's order: every rank runs the same number of full batches).", self.path, rank, batches, local,
                batches * local, low, high,
            )
            return TrainingStream(
                self._reader(with_user_ids=False), segments, rank=rank, num_batches=batches,
                local_batch_size=self.global_batch_size // world_size, max_length=self.max_length,
                num_negatives=self.num_negatives, shuffle=self.shuffle, shuffle_buffer=self.shuffle_buffer, seed=self.seed,
                num_workers=self.num_workers, epoch=getattr(self.trainer, "current_epoch", 0) or 0,
            )
        view: View = self.predict_view if split == "predict" else split  # type: ignore[assignment]
        return EvaluationStream(
            self._reader(with_user_ids=True), segments, self.exact_counts(rank, world_size, view), view=view, rank=rank,
            num_batches=self.evaluation_batches(world_size, view), max_length=self.max_length, num_workers=self.num_workers,
        )

    def _loader(self, split: Split | Literal["predict"]) -> DataLoader:  # type: ignore[override]
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        extra = {"prefetch_factor": self.prefetch_factor} if self.num_workers else {}
        if split != "train":
            return EpochLoader(self.stream(split, rank, world), batch_size=None, num_workers=self.num_workers, **extra)
        loader = TrainingLoader(self.stream(split, rank, world), batch_size=None, num_workers=self.num_workers, **extra)
        if trainer is not None:
            loader.progress = lambda: trainer.fit_loop.epoch_loop.batch_progress.current.processed
        loader.identity = self.epoch_identity(world)
        return loader

    def epoch_identity(self, world_size: int) -> dict[str, object]:
        """What fixes an epoch's training batches on every rank; a mid-epoch resume must find the same."""
        meta = self.metadata
        return {
            "world_size": world_size, "global_batch_size": self.global_batch_size, "num_workers": self.num_workers,
            "shuffle": self.shuffle, "shuffle_buffer": self.shuffle_buffer, "seed": self.seed, "max_length": self.max_length,
            "num_users": meta.num_users, "num_events": meta.num_events,
        }

    def predict_dataloader(self) -> DataLoader:
        return self._loader("predict")

