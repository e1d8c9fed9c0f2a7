"""Checking the sparse input before it reaches TorchRec, and keeping the ranks' batches in step.

FBGEMM clamps an out-of-range id to row 0 and only logs it; a rank that runs out of batches (or
gets an empty one, which row-wise sharding cannot take) leaves the others waiting in an all-to-all.
Every rank therefore checks its batch, then all ranks exchange a few integers on a CPU (gloo)
group before the step: whether each has a batch, its size, and whether its input is valid. They
then act on the same facts: stop together, skip a step together, or raise the same error together.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection, KeyedJaggedTensor

from lightning_recsys.parallel.comm_accounting import comm_purpose

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


def feature_tables(module: nn.Module) -> dict[str, list[TableRef]]:
    """Every sparse feature of ``module``'s TorchRec embedding modules and the tables it looks up.

    (TorchRec gives a table configured without features one named after the table, so a batch
    that lacks it is reported as a missing feature.)
    """
    features: dict[str, list[TableRef]] = {}
    for sub in module.modules():
        if isinstance(sub, EmbeddingBagCollection):
            configs = sub.embedding_bag_configs()
        elif isinstance(sub, EmbeddingCollection):
            configs = sub.embedding_configs()
        else:
            continue
        for config in configs:
            for feature in config.feature_names:
                features.setdefault(feature, []).append(TableRef(config.name, config.num_embeddings))
    return features


class InputValidator:
    """Vectorized checks of a KeyedJaggedTensor against the model's features and table sizes."""

    def __init__(self, features: dict[str, list[TableRef]]) -> None:
        self.features = features
        # A feature feeding several tables must fit the smallest.
        self._limit = {f: min(refs, key=lambda r: r.rows) for f, refs in features.items()}

    def problems(self, kjt: KeyedJaggedTensor, *, batch: int) -> list[str]:
        """Human-readable problems with ``kjt`` (empty when it is valid)."""
        keys = list(kjt.keys())
        missing = sorted(set(self.features) - set(keys))
        extra = sorted(set(keys) - set(self.features))
        problems = []
        if missing:
            problems.append(f"batch {batch}: the batch has no values for feature(s) {missing} that the model's tables need")
        if extra:
            problems.append(
                f"batch {batch}: the batch has feature(s) {extra} that no table uses (the model's features: {sorted(self.features)})"
            )
        values, lengths = kjt.values(), kjt.lengths()
        for name, tensor in (("values", values), ("lengths", lengths)):
            if tensor.dtype not in _ID_DTYPES:
                problems.append(f"batch {batch}: KeyedJaggedTensor {name} have dtype {tensor.dtype}; use torch.int64 or torch.int32")
        if problems:
            return problems
        batch_size = kjt.stride()
        if lengths.numel() != len(keys) * batch_size:
            return [f"batch {batch}: {lengths.numel()} lengths for {len(keys)} features x batch size {batch_size}"]
        total = int(lengths.sum())
        if total != values.numel():
            return [f"batch {batch}: the lengths sum to {total} but there are {values.numel()} values"]
        return self._out_of_range(kjt, keys, values, lengths, batch_size, batch)

    def _out_of_range(
        self, kjt: KeyedJaggedTensor, keys: list[str], values: torch.Tensor, lengths: torch.Tensor, batch_size: int, batch: int
    ) -> list[str]:
        # One min/max pass per feature (torch.repeat_interleave to per-id bounds was 50x slower on CPU).
        per_key = kjt.length_per_key()
        segments = values.split(per_key)
        extremes = [torch.aminmax(seg) for seg in segments if seg.numel()]
        if not extremes:
            return []
        minima = torch.stack([e.min for e in extremes])
        maxima = torch.stack([e.max for e in extremes])
        present = [k for k, seg in zip(keys, segments) if seg.numel()]
        limits = torch.tensor([self._limit[k].rows for k in present], dtype=values.dtype, device=values.device)
        bad_keys = (minima < 0) | (maxima >= limits)
        if not bool(bad_keys.any()):
            return []
        key = present[int(torch.nonzero(bad_keys)[0])]
        index = keys.index(key)
        ref = self._limit[key]
        segment = segments[index]
        bad = (segment < 0) | (segment >= ref.rows)
        first = int(torch.nonzero(bad)[0])
        key_lengths = lengths.view(len(keys), batch_size)[index]
        example = int(torch.searchsorted(torch.cumsum(key_lengths, 0), torch.tensor(first), right=True))
        return [
            f"batch {batch}: feature {key!r} has id {int(segment[first])} at example {example}, but table "
            f"{ref.table!r} has {ref.rows} rows (valid ids are 0..{ref.rows - 1}); {int(bad.sum())} id(s) of that "
            "feature out of range in this batch. Hash or clamp ids in your data pipeline, or enlarge the table."
        ]


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


class CoordinatedBatches:
    """Wraps a rank's dataloader so that all ranks stop, skip or fail on the same step.

    * a rank runs out of batches: every rank stops there (the others' extra batches are dropped);
    * a rank's batch is empty, or sizes differ where the plan needs equal ones (row-wise's
      reduce-scatter): every rank skips that step;
    * invalid input on any rank: every rank raises ``InvalidInputError`` with all ranks' problems
      (``validate="error"``), or logs them and goes on (``"warn"``; FBGEMM then clamps).
    """

    def __init__(
        self,
        loader: Iterable[Any],
        *,
        group: dist.ProcessGroup,
        validator: InputValidator | None,
        validate: ValidateInputs,
        equal_sizes_required: bool,
    ) -> None:
        self.loader = loader
        self._group = group
        self._validator = validator if validate != "off" else None
        self._validate = validate
        self._equal_sizes_required = equal_sizes_required
        self._warnings = 0
        self.dropped_batches = 0
        self.skipped_steps = 0

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)  # sampler, dataset, batch_size, ... for Lightning

    def __iter__(self) -> Iterator[Any]:
        # Double-buffered: batch i+1 is fetched, checked and its handshake started (asynchronously)
        # before batch i is handed to the step, so the exchange overlaps step i's compute.
        iterator = iter(self.loader)
        pending = self._fetch(iterator, 0)
        for index in itertools.count():
            others = pending.result()
            if not all(r.has_batch for r in others):
                self._note_dropped(others)
                return
            if any(r.problems for r in others):
                self._report(pending.problems)
            upcoming = self._fetch(iterator, index + 1)
            sizes = {r.size for r in others if r.size >= 0}
            if 0 in sizes or (self._equal_sizes_required and len(sizes) > 1):
                self.skipped_steps += 1
                self._warn(f"batch {index}: batch sizes per rank {[r.size for r in others]}; skipped on every rank")
            else:
                yield pending.batch
            pending = upcoming

    def _fetch(self, iterator: Iterator[Any], index: int) -> _Handshake:
        batch = next(iterator, _END)
        problems = self._check(batch, index) if batch is not _END else []
        kjts = find_kjts(batch) if batch is not _END else []
        size = kjts[0].stride() if kjts else -1
        mine = torch.tensor([int(batch is not _END), size, len(problems)], dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(self._group))]
        with comm_purpose("batch_handshake"):
            work = dist.all_gather(gathered, mine, group=self._group, async_op=True)
        return _Handshake(batch, problems, work, gathered)

    def _check(self, batch: Any, index: int) -> list[str]:
        if self._validator is None:
            return []
        return [p for kjt in find_kjts(batch) for p in self._validator.problems(kjt, batch=index)]

    def _report(self, problems: list[str]) -> None:
        everyone: list[list[str]] = [[] for _ in range(dist.get_world_size(self._group))]
        dist.all_gather_object(everyone, problems, group=self._group)
        lines = [f"rank {rank}: {p}" for rank, rank_problems in enumerate(everyone) for p in rank_problems]
        message = "invalid sparse input (TwoDRecStrategy validate_inputs=" + repr(self._validate) + "):\n  " + "\n  ".join(lines)
        if self._validate == "error":
            raise InvalidInputError(message + "\nSet validate_inputs='warn' to log and continue (FBGEMM clamps such ids to row 0).")
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
    problems: list[str]
    work: Any
    gathered: list[torch.Tensor]

    def result(self) -> list[RankBatch]:
        self.work.wait()
        return [RankBatch(bool(t[0]), int(t[1]), int(t[2])) for t in self.gathered]


def report_lost_ranks(rank: int, world_size: int, *, wait_seconds: float) -> str:
    """After a failed collective: which ranks are gone? Survivors check in on the rendezvous store.

    Every surviving rank writes a key and waits up to ``wait_seconds`` for the others'; a rank
    that never checks in is reported lost (dead, or stuck in a collective). If the store itself is
    unreachable, its host (rank 0's node) is the one lost.
    """
    # torch keeps the store of init_process_group private; it is the only channel left once a rank is gone.
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"lightning_recsys/survivor/{rank}", "1")
        deadline = time.monotonic() + wait_seconds
        missing = list(range(world_size))
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([f"lightning_recsys/survivor/{r}"])]
            time.sleep(0.2)
    except Exception as error:  # noqa: BLE001 - this is a diagnosis; the original error propagates
        return f"the rendezvous store (hosted with rank 0) is unreachable ({error}); rank 0 is probably lost"
    if not missing:
        return "every rank is still alive; the failure is not a lost rank (see the other ranks' errors)"
    return f"lost rank(s) {missing}: they did not check in within {wait_seconds:.0f}s of the failure (dead, or stuck in a collective)"
