"""Bytes each collective moves: which operation, over which process group, and across nodes or not.

TorchRec issues its all-to-alls and reduce-scatters through ``torch.distributed``'s Python functions
and offers no hook for them, so while an accountant is active those functions are wrapped (the only
patch in this package). DDP's gradient all-reduce runs in C++; it becomes visible by routing it
through a Python comm hook (``sharded_model`` does that).

Each call is filed under its purpose: code in this package labels its own collectives
(``dense_grads``, ``replica_sync``, ``metrics``, ``batch_handshake``) with ``comm_purpose``. The batch
handshake runs when the dataloader yields, between steps, so it is held under its batch and filed under the
step that follows (``release_batch_comm``), or dropped for an evaluation batch (``discard_batch_comm``). Unlabelled collectives on the
sharding group are TorchRec's: ``sparse_ids`` when the payload is int32/int64 (the
KeyedJaggedTensor ids and lengths), ``embeddings`` otherwise (pooled or sequence embeddings and
their gradients, in whatever precision QComms put them). Anything else is ``other``.

What is counted, per call on this rank:

* ``payload_bytes``: the bytes this rank hands to the collective (its input tensors).
* ``inter_node_bytes``: for all-to-alls, exactly the part addressed to ranks on other nodes; for the
  other collectives, the whole payload when the group spans nodes, else 0 (the backend's algorithm
  decides the real wire bytes; a ring all-reduce sends about 2(n-1)/n of the payload).

Beside the rows, the sequence all-to-all's bytes split by feature (``record_lookup``, ``lookup_split``):
what this rank's lookups receive (``embeddings``) and send back (``gradients``), counted from its ids
(``lookup_traffic``). Summed over the ranks the split equals the ``embeddings`` rows of the
``EmbeddingCollection`` tables, QComms scales and index dedup included.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_recsys.parallel.topology import ParallelTopology

COLLECTIVE_OPS: tuple[str, ...] = ("all_to_all", "reduce_scatter", "all_reduce", "all_gather", "broadcast")

# torch.distributed function -> (operation, payload position, payload keyword, group position)
_WRAPPED: dict[str, tuple[str, int, str, int]] = {
    "all_to_all_single": ("all_to_all", 1, "input", 4),
    "all_to_all": ("all_to_all", 1, "input_tensor_list", 2),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input", 3),
    "reduce_scatter": ("reduce_scatter", 1, "input_list", 3),
    "all_reduce": ("all_reduce", 0, "tensor", 2),
    "all_gather": ("all_gather", 1, "tensor", 2),
    "all_gather_into_tensor": ("all_gather", 1, "input_tensor", 2),
    "broadcast": ("broadcast", 0, "tensor", 2),
}


_LABEL = threading.local()


BATCH_HANDSHAKE = "batch_handshake"  # the purpose input_guard's per-batch all_gather is filed under


@contextmanager
def _labelled(attribute: str, value: object) -> Iterator[None]:
    previous = getattr(_LABEL, attribute, None)
    setattr(_LABEL, attribute, value)
    try:
        yield
    finally:
        setattr(_LABEL, attribute, previous)


def comm_purpose(name: str) -> AbstractContextManager[None]:
    """File the collectives issued inside this block (on this thread) under ``name``."""
    return _labelled("purpose", name)


def comm_for_batch(token: object | None) -> AbstractContextManager[None]:
    """File the collectives issued inside this block under the batch ``token`` (None: as usual).

    A pipelined batch's input distribution runs during earlier steps; its collectives are held
    until ``release_batch_comm(token)`` (the batch's step is next), so they count for that step.
    """
    return nullcontext() if token is None else _labelled("batch", token)


def release_batch_comm(token: object) -> None:
    """The batch ``token``'s step runs (or is next): its held collectives join that step."""
    for accountant in list(_ACTIVE):
        accountant.release(token)


def discard_batch_comm(token: object) -> None:
    """The batch ``token`` never runs: forget its held collectives (they stay in the totals)."""
    for accountant in list(_ACTIVE):
        accountant.discard(token)


@dataclass(frozen=True)
class TrafficKey:
    """One row of the accounting: why, which operation, which group, and whether the group spans nodes."""

    purpose: str
    op: str
    group: str
    spans_nodes: bool


@dataclass
class Traffic:
    calls: int = 0
    payload_bytes: int = 0
    inter_node_bytes: int = 0

    def add(self, other: Traffic) -> None:
        self.calls += other.calls
        self.payload_bytes += other.payload_bytes
        self.inter_node_bytes += other.inter_node_bytes


class CommAccountant:
    """Records the collectives this rank issues while active, per training step and in total.

    Groups are named ``world`` when they hold every rank (in 1D that includes the sharding group),
    else ``shard`` (this rank's sharding group), ``replicate`` (its replica group), or by their ranks.
    Unlabelled collectives on the sharding group are filed as ``embedding`` traffic.
    """

    def __init__(
        self, topology: ParallelTopology, sharding_group: dist.ProcessGroup, replica_group: dist.ProcessGroup | None
    ) -> None:
        self.topology = topology
        self._sharding_group = sharding_group
        self._named_groups = {"shard": sharding_group, "replicate": replica_group}
        self._group_info: dict[int, tuple[str, tuple[int, ...], bool]] = {}
        self._keys: dict[tuple[str, str, str], TrafficKey] = {}
        self._lock = threading.Lock()
        self._current: dict[TrafficKey, Traffic] = {}
        self._held: dict[object, dict[TrafficKey, Traffic]] = {}  # by batch token (comm_for_batch)
        self._carried: dict[TrafficKey, Traffic] = {}  # released, for the next step
        self._in_step = False
        self.last_step: dict[TrafficKey, Traffic] = {}
        self.total: dict[TrafficKey, Traffic] = {}
        self.steps = 0
        # Ids per (feature, shard) of this rank's sequence lookups (lookup_traffic), per step and in total, by lookup key.
        self._lookup_current: dict[object, torch.Tensor] = {}
        self.last_step_lookup: dict[object, torch.Tensor] = {}
        self._lookup_total: dict[object, torch.Tensor] = {}
        self._to_bytes: dict[object, Callable[[torch.Tensor], Mapping[tuple[str, str], Any]]] = {}

    # ----------------------------------------------------------------- step boundaries
    def begin_step(self) -> None:
        """Start a training step: collectives from now to ``end_step`` count as this step's.

        The batch handshakes issued since the last step (they run while the batch is fetched) are
        kept: they belong to this step. Anything else since then (setup, evaluation) is not step traffic.
        """
        with self._lock:
            current = {k: t for k, t in self._current.items() if k.purpose == BATCH_HANDSHAKE}
            for key, traffic in self._carried.items():
                current.setdefault(key, Traffic()).add(traffic)
            self._current, self._carried = current, {}
            self._lookup_current = {}  # lookups outside a training step (evaluation) are not step traffic
            self._in_step = True

    def release(self, token: object) -> None:
        """The batch ``token``'s collectives join the running step, or the next one if none runs."""
        with self._lock:
            into = self._current if self._in_step else self._carried
            for key, traffic in self._held.pop(token, {}).items():
                into.setdefault(key, Traffic()).add(traffic)

    def discard(self, token: object) -> None:
        with self._lock:
            self._held.pop(token, None)

    def end_step(self) -> None:
        with self._lock:
            self.last_step, self._current = self._current, {}
            self.last_step_lookup, self._lookup_current = self._lookup_current, {}
            self.steps += 1
            self._in_step = False

    # ----------------------------------------------------------------- reading
    def bytes_by(
        self, *, purpose: str | None = None, op: str | None = None, group: str | None = None, step: str = "last"
    ) -> tuple[int, int]:
        """(payload bytes, inter-node bytes) of the matching rows in the last step (or ``step='total'``)."""
        table = self.last_step if step == "last" else self.total
        rows = [
            t
            for k, t in table.items()
            if (purpose is None or k.purpose == purpose) and (op is None or k.op == op) and (group is None or k.group == group)
        ]
        return sum(t.payload_bytes for t in rows), sum(t.inter_node_bytes for t in rows)

    @property
    def in_step(self) -> bool:
        """Whether a training step is running (between ``begin_step`` and ``end_step``)."""
        return self._in_step

    def record_lookup(self, key: object, counts: torch.Tensor, to_bytes: Callable[[torch.Tensor], Mapping[tuple[str, str], Any]]) -> None:
        """Add one training lookup's ids per (feature, shard) (``lookup_traffic.lookup_counts``) to the running step.

        ``to_bytes`` turns such counts into ``(direction, feature) -> LookupBytes`` when they are read
        (``lookup_split``), so a CUDA step is never stalled to read them. Outside a training step
        (evaluation: no backward) nothing is recorded.
        """
        with self._lock:
            if not self._in_step:
                return
            self._to_bytes[key] = to_bytes
            for table in (self._lookup_current, self._lookup_total):
                table[key] = counts.clone() if key not in table else table[key] + counts

    def lookup_split(self, step: str = "last") -> dict[str, dict[str, tuple[int, int]]]:
        """``feature -> direction -> (payload bytes, inter-node bytes)`` of the last step's (or all) sequence lookups."""
        with self._lock:
            table = dict(self.last_step_lookup if step == "last" else self._lookup_total)
        merged: dict[tuple[str, str], list[int]] = {}
        for key, counts in table.items():
            for part, value in self._to_bytes[key](counts).items():
                cell = merged.setdefault(part, [0, 0])
                cell[0] += value.payload_bytes
                cell[1] += value.inter_node_bytes
        out: dict[str, dict[str, tuple[int, int]]] = {}
        for (direction, feature), (payload, inter) in sorted(merged.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            out.setdefault(feature, {})[direction] = (payload, inter)
        return out

    def as_metrics(self, prefix: str = "comm") -> dict[str, float]:
        """The last step as flat metrics: bytes per (purpose, operation, group), and intra/inter-node totals."""
        metrics: dict[str, float] = {}
        for key, traffic in sorted(self.last_step.items(), key=_row_order):
            metrics[f"{prefix}/{key.purpose}/{key.op}/{key.group}/bytes"] = float(traffic.payload_bytes)
        payload, inter = self.bytes_by()
        metrics[f"{prefix}/inter_node_bytes"] = float(inter)
        metrics[f"{prefix}/intra_node_bytes"] = float(payload - inter)
        return metrics

    def summary(self, step: str = "last") -> str:
        """A fixed-width table of the last step's (or all) traffic, for logs and benchmarks."""
        table = self.last_step if step == "last" else self.total
        header = ("purpose", "op", "group", "spans_nodes", "calls", "payload_bytes", "inter_node_bytes")
        rows = [
            (k.purpose, k.op, k.group, str(k.spans_nodes), str(t.calls), str(t.payload_bytes), str(t.inter_node_bytes))
            for k, t in sorted(table.items(), key=_row_order)
        ]
        widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in [header, *rows])

    # ----------------------------------------------------------------- recording
    def record(self, op: str, group: Any, payload: Any, input_splits: list[int] | None = None) -> None:
        group = group if group is not None else dist.group.WORLD
        name, ranks, spans = self._describe(group)
        if spans:
            payload_bytes, inter = _payload_and_inter_node_bytes(op, payload, input_splits, ranks, self.topology)
        else:  # the common case, per collective per step: no node crossing to work out
            payload_bytes, inter = _tensor_bytes(payload), 0
        purpose = getattr(_LABEL, "purpose", None) or self._torchrec_purpose(group, payload)
        key = self._keys.get((purpose, op, name))
        if key is None:
            key = self._keys[(purpose, op, name)] = TrafficKey(purpose=purpose, op=op, group=name, spans_nodes=spans)
        token = getattr(_LABEL, "batch", None)
        with self._lock:
            step = self._current if token is None else self._held.setdefault(token, {})
            for table in (step, self.total):
                traffic = table.get(key)
                if traffic is None:
                    traffic = table[key] = Traffic()
                traffic.calls += 1
                traffic.payload_bytes += payload_bytes
                traffic.inter_node_bytes += inter

    def _torchrec_purpose(self, group: Any, payload: Any) -> str:
        if group is not self._sharding_group:
            return "other"
        first = payload[0] if isinstance(payload, (list, tuple)) and payload else payload
        is_ids = isinstance(first, torch.Tensor) and first.dtype in (torch.int32, torch.int64)
        return "sparse_ids" if is_ids else "embeddings"

    def _describe(self, group: Any) -> tuple[str, tuple[int, ...], bool]:
        cached = self._group_info.get(id(group))
        if cached is None:
            ranks = tuple(dist.get_process_group_ranks(group))
            name = next((n for n, g in self._named_groups.items() if g is group), "ranks" + ",".join(map(str, ranks)))
            if len(ranks) == dist.get_world_size():
                name = "world"
            cached = self._group_info[id(group)] = (name, ranks, self.topology.spans_nodes(ranks))
        return cached

    def start(self) -> None:
        with _PATCH_LOCK:
            if self not in _ACTIVE:
                _ACTIVE.append(self)
            _install()

    def stop(self) -> None:
        with _PATCH_LOCK:
            if self in _ACTIVE:
                _ACTIVE.remove(self)
            if not _ACTIVE:
                _uninstall()


def _row_order(row: tuple[TrafficKey, Traffic]) -> tuple[str, str, str]:
    return (row[0].purpose, row[0].op, row[0].group)


def _tensor_bytes(payload: Any) -> int:
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size()
    if isinstance(payload, (list, tuple)):
        return sum(_tensor_bytes(p) for p in payload)
    return 0


def _payload_and_inter_node_bytes(
    op: str, payload: Any, input_splits: list[int] | None, ranks: tuple[int, ...], topology: ParallelTopology
) -> tuple[int, int]:
    total = _tensor_bytes(payload)
    if not topology.spans_nodes(ranks):
        return total, 0
    if op != "all_to_all":
        return total, total
    my_node = topology.node_of(dist.get_rank())
    if isinstance(payload, (list, tuple)):
        per_destination = [_tensor_bytes(p) for p in payload]
    elif input_splits:
        row_bytes = total // payload.shape[0] if payload.shape[0] else 0
        per_destination = [split * row_bytes for split in input_splits]
    else:
        per_destination = [total // len(ranks)] * len(ranks)
    inter = sum(b for r, b in zip(ranks, per_destination) if topology.node_of(r) != my_node)
    return total, inter


_ACTIVE: list[CommAccountant] = []
_ORIGINALS: dict[str, Callable[..., Any]] = {}
_PATCH_LOCK = threading.RLock()


def _install() -> None:
    for name, spec in _WRAPPED.items():
        if name not in _ORIGINALS:
            _ORIGINALS[name] = getattr(dist, name)
            setattr(dist, name, _recording(_ORIGINALS[name], *spec))


def _uninstall() -> None:
    for name, original in _ORIGINALS.items():
        setattr(dist, name, original)
    _ORIGINALS.clear()


def _recording(original: Callable[..., Any], op: str, position: int, keyword: str, group_position: int) -> Callable[..., Any]:
    has_splits = original.__name__ == "all_to_all_single"

    @functools.wraps(original)
    def recording_collective(*args: Any, **kwargs: Any) -> Any:
        if _ACTIVE:
            payload = args[position] if len(args) > position else kwargs.get(keyword)
            group = args[group_position] if len(args) > group_position else kwargs.get("group")
            splits = None
            if has_splits:
                splits = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
            for accountant in list(_ACTIVE):
                accountant.record(op, group, payload, splits)
        return original(*args, **kwargs)

    return recording_collective
