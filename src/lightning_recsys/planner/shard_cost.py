"""The shard cost model: what one shard costs its rank per step, which the balanced planner
optimizes and the plan report measures.

Every shard of a plan costs its rank three things per training step:

* **storage**: TorchRec's storage estimate of the shard (weights, optimizer state, I/O
  buffers), in the tier the device uses (HBM on CUDA, DDR on CPU);
* **lookups**: embedding rows read per step, counted in full-width rows: a column shard with
  ``c`` of a table's ``d`` columns counts ``c / d`` per id, a row-wise shard counts the ids that
  land in its rows, a data-parallel replica counts its own rank's ids;
* **comm bytes**: the bytes its embedding exchange moves between its rank and the other ranks of
  the sharding group, at the configured QComms precision: pooled outputs (forward), their
  gradients (backward) and the ids routed to it (input distribution). Following TorchRec's
  estimator, the whole exchange of a shard is counted on the rank that holds it. Data-parallel
  tables exchange nothing; their gradient all-reduce is counted separately;
* **step time**: TorchRec's perf estimate of the shard (forward and backward compute and comms,
  in ms), which also prices what the counts above do not see: narrow column shards run FBGEMM's
  kernels less efficiently, and bandwidths differ inside and across nodes.

With ``b`` examples per rank, ``G`` ranks in the group, ``L`` ids per example and wire bytes
``f``/``g`` per value forward/backward, a table-wise or column-wise shard of ``c`` columns moves
``b (G-1) (c (f + g) + L idx)`` bytes, a row-wise shard ``b (G-1) (d (f + g) + s L idx)`` where
``s`` is its share of the ids (row-wise sums partial outputs over the whole batch, so its payload
does not shrink with its rows), and a data-parallel table all-reduces ``2 (G-1)/G rows d 4``
gradient bytes on every rank.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn
from torchrec.distributed.planner.types import Shard, ShardingOption, Storage
from torchrec.distributed.types import CommOp, ModuleSharder, ShardingType

from lightning_recsys.parallel.comms import BYTE_DTYPES, SCALE_BYTES, wire_bytes_per_value
from lightning_recsys.parallel.sharding import ROW_SHARDED_TYPES
from lightning_recsys.planner.stats import TableStats

METRICS: tuple[str, str, str, str] = ("storage", "lookups", "comm", "step_time")



@dataclass(frozen=True, kw_only=True)
class WireFormat:
    """Bytes on the wire per embedding value, per direction, plus any fixed bytes per row (block scales).

    Args:
        forward, backward: bytes per value of the pooled outputs and of their gradients, > 0.
        forward_row_bytes, backward_row_bytes: extra bytes per row sent (e.g. 4 for the fp32 scale of
            a block-scaled fp8/int8 row), >= 0.
    """

    forward: float = 4.0
    backward: float = 4.0
    forward_row_bytes: float = 0.0
    backward_row_bytes: float = 0.0

    def __post_init__(self) -> None:
        for name in ("forward", "backward"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"WireFormat({name}={value}) must be > 0 bytes per value.")
        for name in ("forward_row_bytes", "backward_row_bytes"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"WireFormat({name}={value}) must be >= 0.")

    def row_bytes(self, columns: int) -> float:
        """Bytes of one row of ``columns`` values, forward plus backward."""
        return columns * (self.forward + self.backward) + self.forward_row_bytes + self.backward_row_bytes

    def describe(self) -> str:
        extra = f" + {self.forward_row_bytes:g}/{self.backward_row_bytes:g} B/row" if self.forward_row_bytes or self.backward_row_bytes else ""
        return f"{self.forward:g}/{self.backward:g} B/value{extra}"


@dataclass(frozen=True, kw_only=True)
class CommCosts:
    """Wire formats of the embedding collectives, and the id and gradient sizes.

    Args:
        pooled_all_to_all: table/column-wise pooled outputs (TorchRec ``POOLED_EMBEDDINGS_ALL_TO_ALL``).
        reduce_scatter: row-wise pooled outputs (``POOLED_EMBEDDINGS_REDUCE_SCATTER``).
        sequence_all_to_all: unpooled (EmbeddingCollection) outputs (``SEQUENCE_EMBEDDINGS_ALL_TO_ALL``).
        index_bytes: bytes per id in the input distribution (8: int64 ids), > 0.
        dense_grad_bytes: bytes per value of a data-parallel table's gradient all-reduce, > 0.
    """

    pooled_all_to_all: WireFormat = WireFormat()
    reduce_scatter: WireFormat = WireFormat()
    sequence_all_to_all: WireFormat = WireFormat()
    index_bytes: float = 8.0
    dense_grad_bytes: float = 4.0

    def __post_init__(self) -> None:
        for name in ("index_bytes", "dense_grad_bytes"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"CommCosts({name}={value}) must be > 0 bytes.")

    @classmethod
    def uniform(cls, forward: float, backward: float, **kwargs: Any) -> CommCosts:
        """The same bytes per value (forward, backward) on every embedding collective."""
        wire = WireFormat(forward=forward, backward=backward)
        return cls(pooled_all_to_all=wire, reduce_scatter=wire, sequence_all_to_all=wire, **kwargs)

    @classmethod
    def from_sharders(cls, sharders: Sequence[ModuleSharder[nn.Module]], **kwargs: Any) -> CommCosts:
        """Read the wire formats from the sharders' ``qcomm_codecs_registry`` (fp32 where none is set)."""
        registry: dict[str, Any] = {}
        for sharder in sharders:
            registry.update(getattr(sharder, "qcomm_codecs_registry", None) or {})
        return cls(
            pooled_all_to_all=_wire_format(registry.get(CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name)),
            reduce_scatter=_wire_format(registry.get(CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.name)),
            sequence_all_to_all=_wire_format(registry.get(CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL.name)),
            **kwargs,
        )

    def describe(self) -> str:
        return (
            f"pooled all-to-all {self.pooled_all_to_all.describe()}, reduce-scatter {self.reduce_scatter.describe()}, "
            f"sequence all-to-all {self.sequence_all_to_all.describe()}, ids {self.index_bytes:g} B"
        )


def _wire_format(codecs: Any) -> WireFormat:
    if codecs is None:
        return WireFormat()
    forward, forward_row = _codec_bytes(codecs.forward)
    backward, backward_row = _codec_bytes(codecs.backward)
    return WireFormat(forward=forward, backward=backward, forward_row_bytes=forward_row, backward_row_bytes=backward_row)


def _fbgemm_codec_precision(codec: Any) -> str | None:
    """``"fp8_e4m3"``/``"int8"`` for FBGEMM's fp8/int8 ``QuantizedCommCodec`` (``parallel.comms.codecs.fbgemm_codec``), else None."""
    name = getattr(getattr(codec, "_comm_precision", None), "name", None)
    if name == "FP8" and getattr(codec, "_row_dim", -1) > 0:
        return "fp8_e4m3"
    return "int8" if name == "INT8" else None


def _codec_bytes(codec: Any) -> tuple[float, float]:
    """(bytes per value, extra bytes per row) of a codec, from QComms' one table (``wire_bytes_per_value``)."""
    precision = getattr(codec, "precision", None)
    if precision in BYTE_DTYPES:
        block = getattr(codec, "_block_size", None)  # set in the final codecs, made for a plan
        if block is not None:
            return wire_bytes_per_value(precision, block), 0.0
        # The planner's codecs: one byte per value plus a scale per block; the block is a shard row
        # at best (it is the gcd of all shard widths, known only once the plan is): a lower bound.
        return wire_bytes_per_value(precision), float(SCALE_BYTES)
    if precision is not None:
        return wire_bytes_per_value(precision), 0.0
    fbgemm = _fbgemm_codec_precision(codec)
    if fbgemm is not None:  # FBGEMM's fused rowwise codecs (CUDA), 8 bytes of scale and padding per row
        return wire_bytes_per_value(fbgemm, getattr(codec, "_row_dim", None), fbgemm=True), 0.0
    dtype = getattr(codec, "quantized_dtype", None)  # TorchRec's own (FBGEMM) codecs
    return (float(dtype.itemsize) if dtype is not None else 4.0), 0.0


@dataclass(frozen=True, kw_only=True)
class BalanceObjective:
    """What the balanced planner minimizes: ``sum_m w_m * f_m`` over storage, lookups, comm and step time.

    ``f_m = max_m + excess_penalty * max(0, max_m / mean_m - 1 - tolerance)``, where ``max_m`` and
    ``mean_m`` are the largest and the mean per-rank load of metric ``m``, in units of an ideal
    rank's load (see ``BalanceContext.refs``). The first term is the min-max load itself (it also
    charges the extra traffic of finer splits); the second makes a rank more than ``tolerance``
    above the mean cost ``excess_penalty`` per unit of imbalance, so the planner trades some total
    traffic for balance only up to that point.

    Args:
        storage, lookups, comm, step_time: weights ``w_m``, >= 0 and not all 0.
        tolerance: the imbalance (max / mean - 1) allowed without penalty, >= 0.
        excess_penalty: the cost per unit of imbalance above ``tolerance``, >= 0.
    """

    storage: float = 1.0
    lookups: float = 1.0
    comm: float = 1.0
    step_time: float = 1.0
    tolerance: float = 0.02
    excess_penalty: float = 10.0

    def __post_init__(self) -> None:
        values = self.weights()
        if any(v < 0 for v in values) or not any(v > 0 for v in values):
            raise ValueError(
                f"BalanceObjective(storage={self.storage}, lookups={self.lookups}, comm={self.comm}, step_time={self.step_time}): "
                "weights must be >= 0 and not all 0."
            )
        if self.tolerance < 0:
            raise ValueError(f"BalanceObjective(tolerance={self.tolerance}) must be >= 0 (an allowed max/mean - 1).")
        if self.excess_penalty < 0:
            raise ValueError(f"BalanceObjective(excess_penalty={self.excess_penalty}) must be >= 0.")

    def weights(self) -> tuple[float, float, float, float]:
        return (self.storage, self.lookups, self.comm, self.step_time)

    def metric_cost(self, metric: int, peak: float, mean: float) -> float:
        """``w_m * f_m`` for one metric with per-rank maximum ``peak`` and mean ``mean``."""
        weight = self.weights()[metric]
        if weight == 0:
            return 0.0
        excess = max(0.0, peak / mean - 1.0 - self.tolerance) if mean > 0 else 0.0
        return weight * (peak + self.excess_penalty * excess)


@dataclass(frozen=True)
class ShardCost:
    """One shard's per-step cost on its rank; ``comm`` is ``a2a_bytes + allreduce_bytes``."""

    storage: float
    lookups: float
    a2a_bytes: float
    allreduce_bytes: float
    step_time_ms: float = 0.0

    @property
    def comm(self) -> float:
        return self.a2a_bytes + self.allreduce_bytes

    def vector(self) -> tuple[float, float, float, float]:
        return (self.storage, self.lookups, self.comm, self.step_time_ms)


@dataclass(frozen=True)
class Imbalance:
    """Max and mean of a per-rank quantity; ``ratio`` is max / mean (1.0 when everything is 0)."""

    max: float
    mean: float

    @property
    def ratio(self) -> float:
        return self.max / self.mean if self.mean > 0 else 1.0

    @classmethod
    def of(cls, values: Sequence[float]) -> Imbalance:
        if not values:
            raise ValueError("Imbalance.of(values=[]) needs at least one rank's value.")
        return cls(max=float(max(values)), mean=float(sum(values)) / len(values))


def storage_tier(compute_device: str) -> str:
    """The Storage field a device's embedding shards live in (TorchRec: hbm on accelerators, ddr on CPU)."""
    return "hbm" if compute_device in ("cuda", "mtia") else "ddr"


def shard_storage(shard: Shard) -> Storage:
    """A copy of the shard's TorchRec storage estimate (zero where it has none yet)."""
    return copy.copy(shard.storage) if shard.storage is not None else Storage(0, 0, 0)


def tier_bytes(storage: Storage, tier: str) -> int:
    """The bytes of ``storage`` in ``tier`` (``hbm`` or ``ddr``)."""
    return int(getattr(storage, tier))


def format_bytes(value: float) -> str:
    """``value`` bytes in GiB, MiB, KiB or B, for reports and error messages."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def shard_cost(
    option: ShardingOption,
    shard_index: int,
    *,
    stats: TableStats,
    batch_size: int,
    group_size: int,
    comm: CommCosts,
    tier: str,
) -> ShardCost:
    """The per-step cost of ``option.shards[shard_index]`` on its rank (see the module docstring)."""
    shard = option.shards[shard_index]
    rows_total, dim = int(option.tensor.shape[0]), int(option.tensor.shape[1])
    row_offset = int(shard.offset[0])
    rows, cols = int(shard.size[0]), int(shard.size[1])
    sharding_type = option.sharding_type
    ids_per_step = batch_size * group_size * stats.lookups_per_example  # ids of the whole group's batch
    storage = float(getattr(shard.storage, tier)) if shard.storage is not None else 0.0
    perf = float(shard.perf.total) if shard.perf is not None else 0.0
    peers = group_size - 1

    if sharding_type == ShardingType.DATA_PARALLEL.value:
        grad_bytes = 2.0 * peers / group_size * rows_total * dim * comm.dense_grad_bytes
        return ShardCost(storage, batch_size * stats.lookups_per_example, 0.0, grad_bytes, perf)

    id_share = stats.share_of_rows(row_offset, row_offset + rows, rows_total) if sharding_type in ROW_SHARDED_TYPES else 1.0
    lookups = ids_per_step * id_share * cols / dim  # table-/row-wise shards have every column
    ids_bytes = batch_size * peers * stats.lookups_per_example * id_share * comm.index_bytes
    if not option.is_pooled:
        # Unpooled (sequence) outputs send one vector per id.
        payload = batch_size * peers * stats.lookups_per_example * id_share * comm.sequence_all_to_all.row_bytes(cols)
    elif sharding_type in ROW_SHARDED_TYPES:
        # Row-wise shards hold partial sums for every example of the group, whatever their rows.
        payload = batch_size * peers * comm.reduce_scatter.row_bytes(cols)
    else:
        payload = batch_size * peers * comm.pooled_all_to_all.row_bytes(cols)
    return ShardCost(storage, lookups, payload + ids_bytes, 0.0, perf)
