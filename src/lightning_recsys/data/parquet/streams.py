"""One rank's batches of a prepared directory: training with a bounded shuffle, evaluation and predict spread evenly.

Examples follow the leave-one-out split of ``SequenceFileDataModule`` (``LeaveOneOutSplit``, per user)
and batches are built by the same ``sequence_batch``; see ``module.py`` for the user-facing rules.

Every example is held in a ``_Pool`` as its own short sequence: only the items (with their actions and
times) its batch can use
(training: the newest ``max_length + 1`` items up to its target; evaluation: the whole prefix up to
its target, which is its seen ids). The pool holds at most ``shuffle_buffer`` examples plus one row
group's, so memory does not grow with the data.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lightning_recsys.data.batch import SequenceBatch
from lightning_recsys.data.parquet.reader import PreparedReader, Segment, UserChunk
from lightning_recsys.data.ranks import rank_range
from lightning_recsys.data.sequences import LeaveOneOutSplit, UserSequences, sequence_batch

View = Literal["train", "val", "test", "full"]
_SHORT_EXCLUDED = {"train": (0, 2), "val": (0, 1), "test": (0, 1), "full": ()}  # short_users indices with no example


@dataclass
class UserSequenceBatch(SequenceBatch):
    """A ``SequenceBatch`` of evaluation or predict examples that also names its users (``user_ids``, kept on the CPU)."""

    user_ids: Any = None  # numpy: int64, or object for string ids

    @classmethod
    def of(cls, batch: SequenceBatch, user_ids: Any) -> UserSequenceBatch:
        """``batch``'s fields (by name: a field added to ``SequenceBatch`` is carried too) with ``user_ids``."""
        return cls(**{f.name: getattr(batch, f.name) for f in fields(SequenceBatch)}, user_ids=user_ids)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> UserSequenceBatch:
        return UserSequenceBatch.of(super().to(device, non_blocking=non_blocking), self.user_ids)

    def pin_memory(self) -> UserSequenceBatch:
        return UserSequenceBatch.of(super().pin_memory(), self.user_ids)


def example_bounds(segment: Segment, view: View) -> tuple[int, int]:
    """``(lower, upper)`` examples of ``view`` in ``segment`` from the metadata alone (exact for a whole row group)."""
    excluded = sum(segment.short_users[i] for i in _SHORT_EXCLUDED[view])
    if segment.whole:
        exact = segment.num_rows - excluded
        return exact, exact
    return max(0, segment.num_rows - excluded), segment.num_rows


def chunk_examples(chunk: UserChunk, view: View) -> tuple[np.ndarray, np.ndarray]:
    """``(users, ends)`` of ``view`` in a chunk: the leave-one-out split's, or every user's whole history (``full``)."""
    if view == "full":
        lengths = chunk.sequences.lengths
        return np.arange(len(lengths), dtype=np.int64), lengths
    return LeaveOneOutSplit(chunk.sequences).examples(view)


class _Pool:
    """Pending examples, each stored as its own sequence; ``take`` hands them out in the pool's order."""

    def __init__(
        self, num_items: int, num_action_types: int, *, keep: int | None, full: bool, with_ids: bool, with_timestamps: bool = False,
    ) -> None:
        self.num_items, self.num_action_types = num_items, num_action_types
        self.keep, self.full, self.with_ids, self.with_timestamps = keep, full, with_ids, with_timestamps
        self.sequences: UserSequences | None = None
        self.ends = np.zeros(0, dtype=np.int64)
        self.order = np.zeros(0, dtype=np.int64)
        self.cursor = 0

    @property
    def pending(self) -> int:
        return len(self.order) - self.cursor

    def add(self, chunk: UserSequences, users: np.ndarray, ends: np.ndarray, rng: np.random.Generator | None) -> None:
        """Append ``chunk``'s examples (``users``, ``ends``) to the unconsumed ones; shuffle them all with ``rng``."""
        rest = self.order[self.cursor :]
        parts = [self._cut(self.sequences, rest, self.ends[rest], own=True)] if self.sequences is not None else []
        parts.append(self._cut(chunk, users, ends, own=False))
        items = np.concatenate([p[0] for p in parts])
        lengths = np.concatenate([p[1] for p in parts])
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        actions = np.concatenate([p[2] for p in parts]) if self.num_action_types else None
        user_ids = np.concatenate([p[3] for p in parts]) if self.with_ids else np.zeros(0, dtype=np.int64)
        timestamps = np.concatenate([p[4] for p in parts]) if self.with_timestamps else None
        self.sequences = UserSequences(
            items=items, offsets=offsets, user_ids=user_ids, num_items=self.num_items,
            num_action_types=self.num_action_types, actions=actions, timestamps=timestamps,
        )
        self.ends = lengths
        self.order = rng.permutation(len(lengths)) if rng is not None else np.arange(len(lengths))
        self.cursor = 0

    def _cut(self, sequences: UserSequences, users: np.ndarray, ends: np.ndarray, *, own: bool) -> tuple:
        """The items of each example that a batch can use, as one sequence per example (see the module docstring);
        ``own``: the pool's own pending examples, already cut."""
        first = sequences.offsets[users]
        start = first if self.keep is None or own else np.maximum(first, first + ends - self.keep)
        stop = first + ends
        if self.full and not own:  # the whole history is the input: a repeat of the last item stands in as its unused target
            starts = np.stack([start, stop - 1], axis=1).reshape(-1)
            stops = np.stack([stop, stop], axis=1).reshape(-1)
            positions = _ranges(starts, stops)
            lengths = stop - start + 1
        else:
            positions = _ranges(start, stop)
            lengths = stop - start
        actions = sequences.actions[positions] if self.num_action_types else None
        ids = sequences.user_ids[users] if self.with_ids else None
        if self.with_timestamps and sequences.timestamps is None:
            raise ValueError("the pool carries timestamps, but these sequences have none.")
        # The full view's repeated last item repeats its time too, so the times stay oldest first.
        timestamps = sequences.timestamps[positions] if self.with_timestamps else None
        return sequences.items[positions], lengths, actions, ids, timestamps

    def take(self, count: int, negatives: torch.Tensor | None, max_length: int, *, build: bool = True) -> SequenceBatch | None:
        chosen = self.order[self.cursor : self.cursor + count]
        self.cursor += len(chosen)
        if not build:
            return None
        assert self.sequences is not None
        batch = sequence_batch(self.sequences, chosen, self.ends[chosen], max_length, negatives=negatives)
        if negatives is not None:
            return batch
        return UserSequenceBatch.of(batch, self.sequences.user_ids[chosen])


def _ranges(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """The positions ``starts[b] .. stops[b] - 1`` of every ``b``, concatenated."""
    lengths = stops - starts
    if not len(lengths):
        return np.zeros(0, dtype=np.int64)
    shifts = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return np.arange(int(lengths.sum()), dtype=np.int64) + shifts


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class EpochLoader(DataLoader):
    """A ``DataLoader`` that starts each pass of its dataset with the next epoch, also in worker processes.

    A worker gets a copy of the dataset when an iteration starts, so an epoch counter advanced inside
    ``__iter__`` would stay behind in the worker; the loader advances it in this process instead.
    """

    def __iter__(self):  # type: ignore[no-untyped-def]
        dataset = self.dataset
        if hasattr(dataset, "begin_epoch"):
            dataset.begin_epoch()  # type: ignore[attr-defined]
        # A resumed epoch's trained batches come through as None, so that the workers keep their turns.
        return (batch for batch in super().__iter__() if batch is not None)


class TrainingLoader(EpochLoader):
    """The training loader, with its own position for mid-epoch checkpoints.

    ``progress()`` (set by the DataModule): the training steps run in the current epoch. Every step
    of this loader runs on every rank (its batches are full and equally many on every rank, so
    none is skipped), so that count is also the batches to pass over on resume, which the stream
    does without building them. ``identity``: the settings that fix an epoch's batches; a mid-epoch
    position saved under others is refused (see ``load_state_dict``).
    """

    progress: Callable[[], int] | None = None
    identity: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        if self.progress is None:
            return {}
        trained = int(self.progress())
        return {"trained_batches": trained, "epoch_done": trained >= len(self.dataset), **(self.identity or {})}  # type: ignore[arg-type]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state or state.get("epoch_done", True):
            return  # an epoch's end: the next epoch starts afresh under any settings
        if "trained_batches" not in state:
            raise ValueError(f"SequenceParquetDataModule: the checkpoint's loader state {state!r} has no 'trained_batches'.")
        differing = {k: (state.get(k), v) for k, v in (self.identity or {}).items() if state.get(k) != v}
        if differing:
            listed = ", ".join(f"{k}: saved {saved!r}, now {now!r}" for k, (saved, now) in sorted(differing.items()))
            raise ValueError(
                f"SequenceParquetDataModule: this checkpoint was saved in the middle of an epoch under other settings ({listed}). "
                "Those settings decide which users each rank reads and in what order, so the rest of that epoch cannot be "
                "continued exactly. Resume with the saved settings, or from a checkpoint saved at the end of an epoch."
            )
        self.dataset.skip = int(state["trained_batches"])  # type: ignore[attr-defined]


class TrainingStream(IterableDataset):
    """Rank ``rank``'s training batches of ``local_batch_size`` examples, ``num_batches`` of them per epoch.

    ``skip``: the next pass hands out its first ``skip`` batches as ``None``, unbuilt (no negatives,
    no tensors; the reads and the shuffle still run so that the rest is the same); ``EpochLoader``
    drops them.

    Each epoch the rank's segments are put in a new order (from ``seed``, the epoch and the rank) and
    dealt to the workers in turn; a worker reads its segments into a pool of at least
    ``shuffle_buffer`` examples, shuffled at each refill, and hands out batches from it. Worker ``k``
    yields ``quotas[k]`` batches, all known in advance from the metadata, so every rank yields the same
    number and no worker runs short.
    """

    def __init__(
        self, reader: PreparedReader, segments: list[Segment], *, rank: int, num_batches: int, local_batch_size: int,
        max_length: int, num_negatives: int | str, shuffle: bool, shuffle_buffer: int, seed: int, num_workers: int, epoch: int,
    ) -> None:
        self.reader, self.segments, self.rank, self.num_batches = reader, segments, rank, num_batches
        self.local_batch_size, self.max_length, self.num_negatives = local_batch_size, max_length, num_negatives
        self.shuffle, self.shuffle_buffer, self.seed, self.num_workers = shuffle, shuffle_buffer, seed, max(1, num_workers)
        self.epoch = epoch  # the next pass's epoch
        self.current_epoch = epoch
        self.skip = 0  # batches of the next pass to hand out unbuilt (a resumed epoch's trained ones)
        self.current_skip = 0

    def begin_epoch(self) -> None:
        self.current_epoch, self.epoch = self.epoch, self.epoch + 1
        self.current_skip, self.skip = self.skip, 0

    def __len__(self) -> int:
        return self.num_batches

    def plan(self, epoch: int) -> tuple[list[list[Segment]], list[int]]:
        """Each worker's segments, in reading order, and its batch quota for ``epoch``."""
        order = np.arange(len(self.segments))
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch, self.rank]).permutation(len(self.segments))
        dealt = [[self.segments[i] for i in order[k :: self.num_workers]] for k in range(self.num_workers)]
        quotas = [sum(example_bounds(s, "train")[0] for s in mine) // self.local_batch_size for mine in dealt]
        excess = sum(quotas) - self.num_batches
        for k in reversed(range(self.num_workers)):  # the later workers give up what the rank does not run
            cut = min(excess, quotas[k])
            quotas[k] -= cut
            excess -= cut
        if excess > 0:
            raise RuntimeError(f"rank {self.rank}: its segments hold fewer training batches than the {self.num_batches} planned.")
        return dealt, quotas

    def negatives(self, rng: np.random.Generator) -> torch.Tensor:
        """The next batch's pool from the worker's stream of draws (one generator per epoch, rank and worker:
        seeding a generator per batch cost as much as building the batch)."""
        num_items = self.reader.metadata.num_items
        if self.num_negatives == "all":
            return torch.arange(num_items, dtype=torch.long)
        return torch.from_numpy(rng.integers(0, num_items, size=int(self.num_negatives), dtype=np.int64))

    def __iter__(self) -> Iterator[SequenceBatch]:
        worker, _ = _worker()
        epoch = self.current_epoch
        dealt, quotas = self.plan(epoch)
        mine, quota = dealt[worker], quotas[worker]
        skip = _worker_skip(self.current_skip, quotas, worker)
        meta = self.reader.metadata
        pool = _Pool(
            meta.num_items, meta.num_action_types, keep=self.max_length + 1, full=False, with_ids=False,
            with_timestamps=self.reader.with_timestamps,
        )
        rng = np.random.default_rng([self.seed, epoch, self.rank, 1 + worker]) if self.shuffle else None
        hold = self.shuffle_buffer if self.shuffle else 0
        draws = np.random.default_rng([self.seed, 0, epoch, self.rank, worker])
        produced, segments = 0, iter(mine)
        while produced < quota:
            segment = next(segments, None)
            if segment is not None:
                chunk = self.reader.read(segment)
                users, ends = chunk_examples(chunk, "train")
                pool.add(chunk.sequences, users, ends, rng)
            while produced < quota and pool.pending >= self.local_batch_size + (hold if segment is not None else 0):
                build = produced >= skip
                negatives = self.negatives(draws)  # drawn for skipped batches too: the later pools stay the same
                negatives = negatives if build else None
                batch = pool.take(self.local_batch_size, negatives, self.max_length, build=build)
                produced += 1
                yield batch  # type: ignore[misc]  # None when skipped (EpochLoader drops it)
            if segment is None and produced < quota:
                raise RuntimeError(f"rank {self.rank}, worker {worker}: ran out of training examples after {produced} of {quota} batches.")


def _worker_skip(skip: int, quotas: list[int], worker: int) -> int:
    """Of the first ``skip`` batches a ``DataLoader`` hands out (worker 0's first, worker 1's first, ..., then
    each worker's second, skipping workers whose quota is spent), how many are ``worker``'s."""
    if skip <= 0:
        return 0
    taken = [0] * len(quotas)
    remaining = skip
    for round_index in range(max(quotas, default=0)):
        for k, quota in enumerate(quotas):
            if remaining == 0:
                return taken[worker]
            if quota > round_index:
                taken[k] += 1
                remaining -= 1
    return taken[worker]


class EvaluationStream(IterableDataset):
    """Rank ``rank``'s ``view`` examples, exactly once, spread over exactly ``num_batches`` non-empty batches.

    ``counts``: each segment's exact number of examples. Batch ``j`` holds the rank's examples
    ``rank_range(total, j, num_batches)``; worker ``k`` makes batches ``rank_range(num_batches, k, workers)``.
    """

    def __init__(
        self, reader: PreparedReader, segments: list[Segment], counts: list[int], *, view: View, rank: int, num_batches: int,
        max_length: int, num_workers: int,
    ) -> None:
        self.reader, self.segments, self.counts, self.view = reader, segments, counts, view
        self.rank, self.num_batches, self.max_length, self.num_workers = rank, num_batches, max_length, max(1, num_workers)
        self.total = sum(counts)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[UserSequenceBatch]:
        if self.total < self.num_batches:
            raise ValueError(
                f"rank {self.rank} has {self.total} {self.view} examples but every rank must run {self.num_batches} "
                "non-empty batches (an empty batch makes every rank skip the step, and its users would go unranked); "
                "use a larger global_batch_size or fewer ranks."
            )
        worker, workers = _worker()
        first_batch, stop_batch = rank_range(self.num_batches, worker, workers)
        if first_batch == stop_batch:
            return
        bounds = [rank_range(self.total, j, self.num_batches) for j in range(first_batch, stop_batch)]
        first, stop = bounds[0][0], bounds[-1][1]
        meta = self.reader.metadata
        pool = _Pool(
            meta.num_items, meta.num_action_types, keep=None, full=self.view == "full", with_ids=True,
            with_timestamps=self.reader.with_timestamps,
        )
        seen = 0  # examples of the rank before the current segment
        sizes = iter([b - a for a, b in bounds])
        size = next(sizes, None)
        for segment, count in zip(self.segments, self.counts):
            lo, hi = seen, seen + count
            seen = hi
            if hi <= first or count == 0:
                continue
            if lo >= stop:
                break
            chunk = self.reader.read(segment)
            users, ends = chunk_examples(chunk, self.view)
            if len(users) != count:
                raise RuntimeError(f"{segment.where()}: {len(users)} {self.view} examples, planned {count}.")
            keep = slice(max(first - lo, 0), min(stop, hi) - lo)
            pool.add(chunk.sequences, users[keep], ends[keep], None)
            while size is not None and pool.pending >= size:
                yield pool.take(size, None, self.max_length)  # type: ignore[misc]
                size = next(sizes, None)


def evaluation_batches(uppers: list[int], batch_size: int) -> int:
    """The evaluation batches every rank runs: enough that the rank with the most examples has ``<= batch_size`` per batch."""
    return max((math.ceil(u / batch_size) for u in uppers), default=0)
