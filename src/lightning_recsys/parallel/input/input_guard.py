"""Checking the sparse input before it reaches TorchRec, and keeping the ranks' batches in step.

FBGEMM clamps an out-of-range id to row 0 and only logs it; a rank that runs out of batches (or
gets an empty one, which row-wise sharding cannot take) leaves the others waiting in an all-to-all.
Every rank therefore checks its batch, then all ranks exchange a few integers on a CPU (gloo)
group before the step: whether each has a batch, its size, and whether its input is valid. They
then act on the same facts: stop together, skip a step together, or raise the same error together.

A problem is *fatal* when no setting can make the step right (duplicate or missing keys, lengths
or weights that do not match the values, non-finite weights, a check that itself failed): it
raises on every rank even with ``validate_inputs="warn"``. Only out-of-range ids (which FBGEMM
clamps) and weights that an unweighted model ignores can be downgraded to a warning. A check never
raises on its own rank: whatever goes wrong becomes a problem every rank learns of in the handshake.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import operator
from collections import Counter
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection, KeyedJaggedTensor

from lightning_recsys.parallel.comms import comm_for_batch, comm_purpose, discard_batch_comm, release_batch_comm
from lightning_recsys.parallel.input.input_pipeline import SparseDistPipeline, pipelined
from lightning_recsys.parallel.input.loader_position import LoaderPosition, Progress, drop_first
from lightning_recsys.parallel.topology import raised_on_every_rank

log = logging.getLogger(__name__)

ValidateInputs = Literal["error", "warn", "off"]
VALIDATE_INPUTS: tuple[str, ...] = ("error", "warn", "off")
_ID_DTYPES = (torch.int32, torch.int64)
_MAX_WARNINGS = 10


class InvalidInputError(ValueError):
    """A batch's sparse features do not fit the model's tables (raised on every rank)."""


@dataclass(frozen=True)
class TableRef:
    table: str
    rows: int
    weighted: bool = False  # EmbeddingBagCollection(is_weighted=True): pools with per-id weights


@dataclass(frozen=True)
class InputProblem:
    """One problem with a batch. ``fatal``: the step cannot run correctly whatever ``validate_inputs`` says."""

    message: str
    fatal: bool = True


def feature_tables(module: nn.Module) -> dict[str, list[TableRef]]:
    """Every sparse feature of ``module``'s TorchRec embedding modules and the tables it looks up.

    (TorchRec gives a table configured without features one named after the table, so a batch
    that lacks it is reported as a missing feature.)
    """
    features: dict[str, list[TableRef]] = {}
    for sub in module.modules():
        if isinstance(sub, EmbeddingBagCollection):
            configs, weighted = sub.embedding_bag_configs(), sub.is_weighted()
        elif isinstance(sub, EmbeddingCollection):
            configs, weighted = sub.embedding_configs(), False
        else:
            continue
        for config in configs:
            for feature in config.feature_names:
                features.setdefault(feature, []).append(TableRef(config.name, config.num_embeddings, weighted))
    return features


class InputValidator:
    """Vectorized checks of a KeyedJaggedTensor against the model's features and table sizes."""

    def __init__(self, features: dict[str, list[TableRef]]) -> None:
        self.features = features
        # A feature feeding several tables must fit the smallest.
        self._limit = {f: min(refs, key=lambda r: r.rows) for f, refs in features.items()}

    def problems(self, kjt: KeyedJaggedTensor, *, batch: int) -> list[str]:
        """Human-readable problems with ``kjt`` (empty when it is valid)."""
        return [p.message for p in self.check(kjt, batch=batch)]

    def check_batch(self, kjts: list[KeyedJaggedTensor], *, batch: int) -> list[InputProblem]:
        """The problems with a batch's KeyedJaggedTensors taken together.

        A batch may carry one KeyedJaggedTensor per embedding module (a two-tower model's user and
        item features): a feature is missing only when none of them has it.
        """
        if len(kjts) == 1:
            return self.check(kjts[0], batch=batch)
        present = {key for kjt in kjts for key in kjt.keys()}
        problems = self._missing(present, batch)
        return problems + [p for kjt in kjts for p in self.check(kjt, batch=batch, require_every_feature=False)]

    def check(self, kjt: KeyedJaggedTensor, *, batch: int, require_every_feature: bool = True) -> list[InputProblem]:
        """The problems with ``kjt``, each marked fatal or not (see the module docstring).

        ``require_every_feature=False``: ``kjt`` is one of several in the batch, which together must hold every feature.
        """
        keys = list(kjt.keys())
        problems = self._keys(keys, batch, require_every_feature)
        values, lengths = kjt.values(), kjt.lengths()
        for name, tensor in (("values", values), ("lengths", lengths)):
            if tensor.dtype not in _ID_DTYPES:
                problems.append(
                    InputProblem(f"batch {batch}: KeyedJaggedTensor {name} have dtype {tensor.dtype}; use torch.int64 or torch.int32")
                )
        if problems:
            return problems
        batch_size = kjt.stride()
        if lengths.numel() != len(keys) * batch_size:
            return [InputProblem(f"batch {batch}: {lengths.numel()} lengths for {len(keys)} features x batch size {batch_size}")]
        total = int(lengths.sum())
        if total != values.numel():
            return [InputProblem(f"batch {batch}: the lengths sum to {total} but there are {values.numel()} values")]
        weight_problems = self._weights(kjt, keys, values, lengths, batch_size, batch)
        if any(p.fatal for p in weight_problems):
            return weight_problems
        return weight_problems + self._out_of_range(kjt, keys, values, lengths, batch_size, batch)

    def _missing(self, keys: set[str], batch: int) -> list[InputProblem]:
        missing = sorted(set(self.features) - keys)
        if not missing:
            return []
        return [InputProblem(f"batch {batch}: the batch has no values for feature(s) {missing} that the model's tables need")]

    def _keys(self, keys: list[str], batch: int, require_every_feature: bool = True) -> list[InputProblem]:
        problems = []
        duplicated = sorted(k for k, n in Counter(keys).items() if n > 1)
        if duplicated:
            where = "; ".join(f"{k!r} at key positions {[i for i, x in enumerate(keys) if x == k]}" for k in duplicated)
            problems.append(InputProblem(
                f"batch {batch}: the KeyedJaggedTensor has duplicate key(s): {where} (keys {keys}). Each feature must "
                "appear once (TorchRec does not check this, and sends a repeated block to the wrong table); merge the "
                "ids into one key, or name each block after the feature of its table."
            ))
        if require_every_feature:
            problems += self._missing(set(keys), batch)
        extra = sorted(set(keys) - set(self.features))
        if extra:
            problems.append(InputProblem(
                f"batch {batch}: the batch has feature(s) {extra} that no table uses (the model's features: {sorted(self.features)})"
            ))
        return problems

    def _weights(
        self, kjt: KeyedJaggedTensor, keys: list[str], values: torch.Tensor, lengths: torch.Tensor, batch_size: int, batch: int
    ) -> list[InputProblem]:
        weights = kjt.weights_or_none()
        weighted = {k: [r.table for r in self.features[k] if r.weighted] for k in keys}
        needing = {k: tables for k, tables in weighted.items() if tables}
        if weights is None:
            if not needing:
                return []
            return [InputProblem(
                f"batch {batch}: feature(s) {sorted(needing)} feed weighted table(s) "
                f"{sorted({t for ts in needing.values() for t in ts})} (EmbeddingBagCollection(is_weighted=True)), but the "
                "KeyedJaggedTensor has no weights. Pass weights= (one float per id), or build the collection with "
                "is_weighted=False."
            )]
        if not weights.is_floating_point():
            return [InputProblem(f"batch {batch}: KeyedJaggedTensor weights have dtype {weights.dtype}; use a float dtype (torch.float32)")]
        if weights.numel() != values.numel():
            return [InputProblem(
                f"batch {batch}: the KeyedJaggedTensor has {weights.numel()} weights for {values.numel()} ids; "
                "give exactly one weight per id (weights and values have the same length)."
            )]
        finite = torch.isfinite(weights)
        if not bool(finite.all()):
            index, offset = self._first_bad(kjt, ~finite)
            example = self._example(lengths, len(keys), batch_size, index, offset)
            return [InputProblem(
                f"batch {batch}: feature {keys[index]!r} has a non-finite weight at example {example}; "
                f"{int((~finite).sum())} non-finite weight(s) in this batch. Weights must be finite: fix or drop them "
                "in your data pipeline."
            )]
        if not needing:
            # TorchRec's unweighted collections drop the weights: say so, it is usually a forgotten is_weighted=True.
            return [InputProblem(
                f"batch {batch}: the KeyedJaggedTensor carries weights, but no table its features feed is weighted, so "
                "they are ignored. Build the EmbeddingBagCollection with is_weighted=True, or drop the weights.",
                fatal=False,
            )]
        return []

    @staticmethod
    def _first_bad(kjt: KeyedJaggedTensor, bad: torch.Tensor) -> tuple[int, int]:
        """(key index, offset within that key's ids) of the first True in ``bad`` (one flag per id)."""
        position = int(torch.nonzero(bad)[0])
        starts = [0, *itertools.accumulate(kjt.length_per_key())]
        index = next(i for i in range(len(starts) - 1) if starts[i] <= position < starts[i + 1])
        return index, position - starts[index]

    @staticmethod
    def _example(lengths: torch.Tensor, num_keys: int, batch_size: int, index: int, offset: int) -> int:
        """The example holding the ``offset``-th id of key ``index``."""
        key_lengths = lengths.view(num_keys, batch_size)[index]
        return int(torch.searchsorted(torch.cumsum(key_lengths, 0), torch.tensor(offset), right=True))

    def _out_of_range(
        self, kjt: KeyedJaggedTensor, keys: list[str], values: torch.Tensor, lengths: torch.Tensor, batch_size: int, batch: int
    ) -> list[InputProblem]:
        # One min/max pass per feature (torch.repeat_interleave to per-id bounds was 50x slower on CPU).
        per_key = kjt.length_per_key()
        segments = values.split(per_key)
        present = [i for i, seg in enumerate(segments) if seg.numel()]  # positions, not names: never keys.index()
        if not present:
            return []
        extremes = [torch.aminmax(segments[i]) for i in present]
        minima = torch.stack([e.min for e in extremes])
        maxima = torch.stack([e.max for e in extremes])
        limits = torch.tensor([self._limit[keys[i]].rows for i in present], dtype=values.dtype, device=values.device)
        bad_keys = (minima < 0) | (maxima >= limits)
        if not bool(bad_keys.any()):
            return []
        index = present[int(torch.nonzero(bad_keys)[0])]
        key, segment = keys[index], segments[index]
        ref = self._limit[key]
        bad = (segment < 0) | (segment >= ref.rows)
        first = int(torch.nonzero(bad)[0])
        example = self._example(lengths, len(keys), batch_size, index, first)
        return [InputProblem(
            f"batch {batch}: feature {key!r} has id {int(segment[first])} at example {example}, but table "
            f"{ref.table!r} has {ref.rows} rows (valid ids are 0..{ref.rows - 1}); {int(bad.sum())} id(s) of that "
            "feature out of range in this batch. Hash or clamp ids in your data pipeline, or enlarge the table.",
            fatal=False,
        )]


def find_kjts(batch: Any) -> list[KeyedJaggedTensor]:
    """The KeyedJaggedTensors in a batch (a RecBatch, dict, list, tuple or dataclass)."""
    if isinstance(batch, KeyedJaggedTensor):
        return [batch]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return [k for f in dataclasses.fields(batch) for k in find_kjts(getattr(batch, f.name))]
    if isinstance(batch, dict):
        return [k for v in batch.values() for k in find_kjts(v)]
    if isinstance(batch, (list, tuple)):
        return [k for v in batch for k in find_kjts(v)]
    return []


@dataclass(frozen=True)
class RankBatch:
    """What one rank tells the others about its next batch."""

    has_batch: bool
    size: int  # examples; -1 when the batch carries no KeyedJaggedTensor to count
    problems: int
    fatal: int  # how many of the problems no validate_inputs setting may downgrade
    stop: int = 0  # the rank was asked to stop, why as the caller's bit flags (SIGTERM, a requeue): every rank stops on this step


class CoordinatedBatches:
    """Wraps a rank's dataloader so that all ranks stop, skip or fail on the same step.

    * a rank runs out of batches: every rank stops there (the others' extra batches are dropped);
    * a rank's batch is empty, or sizes differ where the plan needs equal ones (row-wise's
      reduce-scatter): every rank skips that step;
    * invalid input on any rank: every rank raises ``InvalidInputError`` with all ranks' problems
      (``validate="error"``, or any fatal problem), or logs them and goes on (``"warn"``; FBGEMM
      then clamps);
    * the check, or the rank's dataloader, raises: that becomes a fatal problem of the rank, so
      every rank raises together (the rank whose loader raised re-raises its own exception).

    ``pipeline``: a ``SparseDistPipeline``; each agreed batch's input distribution then starts
    (after its check and handshake) before the batch ahead of it is yielded. ``training()`` says
    whether the batches feed training steps (their collectives are accounted to those steps).
    ``progress()``: the training loop's steps run in this epoch, and whether it counts the epoch as
    complete; with it, ``state_dict`` / ``load_state_dict`` resume a mid-epoch checkpoint at the next
    batch (``LoaderPosition``; a loader with its own ``state_dict`` keeps it instead).
    ``checked_before``: the caller's batch hooks that change a batch after this check (a Lightning
    module's ``on_before_batch_transfer``, ...); a report of bad input names them.
    ``stop_requested()``: whether, and why, this rank was asked to stop (non-zero bit flags of the
    caller's: its SIGTERM, a requeue signal); it rides in the handshake, and ``on_stop(ranks, requests)``
    (the ranks that asked, their flags or-ed) runs on every rank at the same step once any rank asked.
    """

    def __init__(
        self,
        loader: Iterable[Any],
        *,
        group: dist.ProcessGroup,
        validator: InputValidator | None,
        validate: ValidateInputs,
        equal_sizes_required: bool,
        pipeline: SparseDistPipeline | None = None,
        training: Callable[[], bool] = lambda: False,
        progress: Progress | None = None,
        stop_requested: Callable[[], int] = lambda: 0,
        on_stop: Callable[[list[int], int], None] = lambda ranks, requests: None,
        checked_before: tuple[str, ...] = (),
    ) -> None:
        self.loader = loader
        self._checked_before = checked_before
        self._stop_requested = stop_requested
        self._on_stop = on_stop
        self._position = LoaderPosition(progress)
        self.pipeline = pipeline
        self._training = training
        self._group = group
        self._validator = validator if validate != "off" else None
        self._validate = validate
        self._equal_sizes_required = equal_sizes_required
        self._warnings = 0
        self.dropped_batches = 0
        self.skipped_steps = 0

    def __len__(self) -> int:
        # An empty loader counts as one batch. Lightning decides on each rank alone what a loop of zero
        # batches does: it raised "within local rank has zero length" on that rank only, or (with
        # allow_zero_length_dataloader_with_multiple_devices) skipped the loop there while the other
        # ranks waited in the batch handshake until process_group_timeout. Counted as one, the loop runs
        # on every rank, and the first handshake stops every rank there, as for any uneven end.
        return max(1, len(self.loader))  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)  # sampler, dataset, batch_size, ... for Lightning

    def _loader_is_stateful(self) -> bool:
        return callable(getattr(self.loader, "state_dict", None)) and callable(getattr(self.loader, "load_state_dict", None))

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict() if self._loader_is_stateful() else self._position.state_dict()  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._loader_is_stateful():
            self.loader.load_state_dict(state)  # type: ignore[attr-defined]
        else:
            self._position.load_state_dict(state)

    def __iter__(self) -> Iterator[Any]:
        first_step, skip = (0, 0) if self._loader_is_stateful() else self._position.start()
        source = drop_first(iter(self.loader), skip, _END) if skip else iter(self.loader)
        agreed = self._agreed(source, tagged=True, first_step=first_step, skipped=skip)
        if self.pipeline is None or not self.pipeline.enabled:
            return self._settled(agreed)
        return pipelined(agreed, self.pipeline, account=self._training)

    def _settled(self, agreed: Generator[tuple[Any, object], None, None]) -> Iterator[Any]:
        """The batches, with the handshakes issued up to each one filed under the training step it feeds,
        or dropped when it feeds none (sanity check, validation, test, predict), as the pipeline does."""
        try:
            for batch, token in agreed:
                (release_batch_comm if self._training() else discard_batch_comm)(token)
                yield batch
        finally:
            agreed.close()  # a loop that stopped early: its handshake in flight completes now (see _agreed)

    def _agreed(self, iterator: Iterator[Any], *, tagged: bool, first_step: int = 0, skipped: int = 0) -> Generator[Any, None, None]:
        """The batches every rank runs.

        Double-buffered: batch i+1 is fetched, checked and its handshake started (asynchronously)
        before batch i is handed to the step, so the exchange overlaps step i's compute.
        ``tagged``: yield ``(batch, token)``; the handshakes issued up to that yield are held under
        ``token`` in the accounting (the pipeline yields a batch later than this, and releases it then).
        ``first_step``, ``skipped``: a resumed epoch's first step and the source batches dropped before.
        """
        step = first_step
        token = object() if tagged else None
        pending = self._fetch(iterator, 0, token)
        in_flight: _Handshake | None = pending
        try:
            for index in itertools.count():
                others = pending.result()
                in_flight = None
                stopping = [rank for rank, r in enumerate(others) if r.stop]
                if stopping:
                    self._on_stop(stopping, functools.reduce(operator.or_, (r.stop for r in others)))
                if any(r.problems for r in others):  # first: a rank whose loader raised must not stop silently
                    self._report(pending.problems, fatal=any(r.fatal for r in others), own_error=pending.error)
                if not all(r.has_batch for r in others):
                    self._note_dropped(others)
                    self._position.exhausted()
                    return
                upcoming = in_flight = self._fetch(iterator, index + 1, token)
                sizes = {r.size for r in others if r.size >= 0}
                if 0 in sizes or (self._equal_sizes_required and len(sizes) > 1):
                    self.skipped_steps += 1
                    self._warn(f"batch {index}: batch sizes per rank {[r.size for r in others]}; skipped on every rank")
                else:
                    self._position.yielded(step, skipped + index + 1)
                    step += 1
                    yield (pending.batch, token) if tagged else pending.batch
                    token = object() if tagged else None
                pending = upcoming
        finally:
            # The loop stopped early (max_steps, limit_*_batches) with the next handshake in flight.
            # Every rank started it, so it completes; wait for it here, while the process group is
            # alive, rather than leave gloo's worker thread holding it until interpreter shutdown.
            if in_flight is not None:
                in_flight.drain()

    def _fetch(self, iterator: Iterator[Any], index: int, token: object | None = None) -> _Handshake:
        # Nothing here may raise before the all-gather: a rank that raised alone would leave the
        # others waiting in the handshake until the process group's timeout.
        error: Exception | None = None
        try:
            batch = next(iterator, _END)
        except Exception as e:  # noqa: BLE001 - reported to every rank, then re-raised here
            batch, error = None, e
        if error is not None:
            problems = [InputProblem(f"batch {index}: the dataloader raised {type(error).__name__}: {error}")]
            size = -1
        else:
            problems, size = self.check(batch, index) if batch is not _END else ([], -1)
        fatal = sum(p.fatal for p in problems)
        mine = torch.tensor([int(batch is not _END), size, len(problems), fatal, int(self._stop_requested())], dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(self._group))]
        with comm_purpose("batch_handshake"), comm_for_batch(token):
            work = dist.all_gather(gathered, mine, group=self._group, async_op=True)
        return _Handshake(batch, problems, work, gathered, error)

    def check(self, batch: Any, index: int) -> tuple[list[InputProblem], int]:
        """This rank's problems with ``batch`` and its size (-1: no KeyedJaggedTensor); never raises."""
        size = -1
        try:
            kjts = find_kjts(batch)
            size = kjts[0].stride() if kjts else -1
            if self._validator is None:
                return [], size
            return self._validator.check_batch(kjts, batch=index) if kjts else [], size
        except Exception as error:  # noqa: BLE001 - a malformed batch can break any step of the check
            log.debug("TwoDRecStrategy: the input check of batch %d raised", index, exc_info=True)
            return [InputProblem(
                f"batch {index}: checking the batch raised {type(error).__name__}: {error}. The batch is malformed "
                "(e.g. a KeyedJaggedTensor whose keys, lengths, offsets or stride disagree); build it with "
                "KeyedJaggedTensor.from_lengths_sync(keys=..., values=..., lengths=...)."
            )], size

    def _report(self, problems: list[InputProblem], *, fatal: bool, own_error: Exception | None) -> None:
        everyone: list[list[tuple[str, bool]]] = [[] for _ in range(dist.get_world_size(self._group))]
        dist.all_gather_object(everyone, [(p.message, p.fatal) for p in problems], group=self._group)
        if own_error is not None:
            raise raised_on_every_rank(own_error)  # this rank's dataloader failed; the others raise InvalidInputError naming it
        lines = [f"rank {rank}: {m}" for rank, rank_problems in enumerate(everyone) for m, _ in rank_problems]
        message = "invalid sparse input (TwoDRecStrategy validate_inputs=" + repr(self._validate) + "):\n  " + "\n  ".join(lines)
        if self._checked_before:
            message += (
                f"\nThe batches are checked as the dataloader yields them, before {list(self._checked_before)} run, so ids "
                "mapped into range there (hashing, remapping) are checked unmapped, and what those hooks change is not "
                "checked. Map the ids in the dataset or its collate_fn instead, or set GuardConfig(validate_inputs='off')."
            )
        if fatal:
            raise raised_on_every_rank(InvalidInputError(
                message + "\nThese problems stop training whatever validate_inputs says: no clamp can make such a batch right."
            ))
        if self._validate == "error":
            raise raised_on_every_rank(
                InvalidInputError(message + "\nSet validate_inputs='warn' to log and continue (FBGEMM clamps such ids to row 0).")
            )
        self._warn(message)

    def _note_dropped(self, others: list[RankBatch]) -> None:
        ahead = sum(r.has_batch for r in others)
        if ahead:
            self.dropped_batches += ahead
            self._warn(
                f"ranks ran out of batches unevenly (ranks with a batch left: "
                f"{[i for i, r in enumerate(others) if r.has_batch]}); every rank stops here, dropping those batches"
            )

    def _warn(self, message: str) -> None:
        self._warnings += 1
        if self._warnings <= _MAX_WARNINGS:
            suffix = " (further warnings suppressed)" if self._warnings == _MAX_WARNINGS else ""
            log.warning("TwoDRecStrategy: %s%s", message, suffix)


_END = object()


@dataclass
class _Handshake:
    """One batch and the in-flight exchange about it."""

    batch: Any
    problems: list[InputProblem]
    work: Any
    gathered: list[torch.Tensor]
    error: Exception | None = None  # this rank's dataloader raised it

    def result(self) -> list[RankBatch]:
        self.work.wait()
        return [
            RankBatch(bool(has), size, problems, fatal, stop) for has, size, problems, fatal, stop in (t.tolist() for t in self.gathered)
        ]

    def drain(self) -> None:
        """Wait for the exchange without using it; a failure here (a peer gone) is left to the caller's error."""
        try:
            self.work.wait()
        except (RuntimeError, dist.DistError) as error:  # the run is already ending or failing
            log.debug("in-flight batch handshake failed while closing: %s", error)
