"""Per-step bytes of 1D and 2D training from a workload's shape: pooled and sequence features, Zipf ids, touched-row sync.

Trainer-free (no Lightning imports); the collectives it returns are timed by ``cost_model.step_time``.

**Union of touched rows (Zipf ids).** A table of ``N`` rows is looked up with i.i.d. ids of a Zipf
law, ``P(row of popularity rank i) = p_i = i^-s / H(N, s)`` with ``H(N, s) = sum_{i<=N} i^-s``.
Among ``M`` draws, row i is missed with probability ``(1 - p_i)^M``, so the expected number of
distinct rows touched is

    D(N, s, M) = sum_{i=1..N} 1 - (1 - p_i)^M.

It is computed exactly for the ``_HEAD`` most popular rows and, beyond them, as the integral
``int 1 - exp(-M x^-s / H) dx`` from ``_HEAD + 1/2`` to ``N + 1/2`` (the midpoint rule's error is
second order in the slope of a smooth tail), on a geometric grid; ``H`` the same way. For
``M << N`` it tends to ``M`` (every draw new), for ``M >> N`` to ``N``; ``s = 0`` is uniform ids.

Between two syncs every replica of a shard looks up the ids of its own sharding group's examples,
so the union over the replica group is ``D`` of the ids of **all** the world's examples over the
interval: ``M = k x batch_per_rank x world x ids_per_example`` for a sync every ``k`` steps. One
replica's own touched rows (the index list it contributes to the union) use its group's examples:
``M = k x batch_per_rank x sharding_group_size x ids_per_example``.

**Traffic per rank and step** (``workload_traffic``), symmetric ranks, b examples per rank:

* ``sparse_ids``: KJT all-to-all over the sharding group, 3 calls, ``b sum_f T_f (L_f id_bytes + length_bytes)``;
* ``embeddings``: all-to-all over the sharding group, forward + backward. A **pooled** feature
  (``EmbeddingBagCollection``) sends one vector per example, ``b T row_bytes``; a **sequence**
  feature (``EmbeddingCollection``) sends every looked-up vector, ``b T L row_bytes``;
* ``dense_grads``: DDP's all-reduce over the world; with ``staged_dense`` (2D on gloo across nodes,
  ``dense_all_reduce``) one all-reduce inside the sharding group and one across the replica group;
* ``replica_sync`` (2D): ``rows="all"``: the rank's shard, ``sum_f T_f N_f (D_f + state) 4 / g`` per
  sync; ``rows="touched"``: the union's rows, ``sum_f T_f D(N_f, s_f, M_f) (D_f + state) v / g``
  (``v`` = 4 bytes for fp32, 2 for bf16 deltas), an all-reduce (plus one 8-byte count all-reduce),
  and the union agreement, an all-gather of each replica's touched row ids (4 bytes each) or of
  1-bit row masks, whichever is smaller. With ``exchange="all_gather"`` instead one all-gather of
  each replica's own touched rows, ``sum_f T_f D(N_f, s_f, M_own) (4 + change bytes + 4 state) / g``
  (the row id, the weights' change at the sync's precision, fp8 with a 4-byte scale per row, and the
  state's in fp32), which every ring edge carries ``replicas - 1`` times, plus the per-table counts.
  All divided by ``k`` per step.

**Index dedup** (``StrategyChoice(index_dedup=True)``, TorchRec's
``EmbeddingCollectionSharder(use_index_dedup=True)``): ``ShardedEmbeddingCollection._dedup_indices``
(``torchrec/distributed/embedding.py``) runs ``fbgemm.jagged_unique_indices`` on each rank's own KJT,
after the split by sharding type and **before** the input all-to-all. Its hash-size offsets give all
features of one table one id range, so ids are unique **per table** over the rank's local batch (not
across ranks); lengths stay per example, and the output all-to-all returns one vector per unique id,
expanded by ``reverse_indices`` after it (the backward sends the summed gradients of the same unique
ids). So a sequence feature's ids and vectors per rank become ``T D(N, s, b L)`` instead of ``T b L``.
``EmbeddingBagCollection`` (pooled) features have no such option and are unchanged. The model counts
bytes only: the dedup kernel's own time is not in it (and ``jagged_unique_indices`` has no CPU kernel
in fbgemm-gpu-cpu 1.8.0, so it runs on GPUs only).

So per step, 1D carries ``b L`` vectors per sequence feature across nodes but only ``b`` per pooled
one, while touched-row sync carries each unique touched row of the interval (a ring all-reduce:
about twice), divided by ``k``: 2D gains with hot ids (a small union), long intervals and sequence
features, and can lose to 1D FP8 on single-hot pooled features with long tails.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from lightning_recsys.parallel.sync import ReplicaSyncConfig, change_bytes_per_row
from lightning_recsys.parallel.topology import LAYOUTS, ParallelTopology
from lightning_recsys.planner.cost.cost_model import Collective, row_bytes

_HEAD = 4096  # rows summed exactly
_GRID = 2048  # intervals of the geometric grid for the tail integrals
SYNC_VALUE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2}


# --------------------------------------------------------------------------- Zipf
def _tail_integral(f: Callable[[float], float], a: float, b: float) -> float:
    """int_a^b f(x) dx by the trapezoid rule in u = log x (a smooth, monotone integrand)."""
    if b <= a:
        return 0.0
    la, lb = math.log(a), math.log(b)
    h = (lb - la) / _GRID
    total = 0.0
    for i in range(_GRID + 1):
        x = math.exp(la + i * h)
        total += (0.5 if i in (0, _GRID) else 1.0) * f(x) * x
    return total * h


def _check_zipf(rows: int, exponent: float) -> None:
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows={rows!r} must be an integer >= 1.")
    if not (exponent >= 0 and math.isfinite(exponent)):
        raise ValueError(f"zipf exponent={exponent!r} must be a finite number >= 0 (0 is uniform).")


@lru_cache(maxsize=4096)
def zipf_normalizer(rows: int, exponent: float) -> float:
    """``H(rows, s) = sum_{i=1..rows} i^-s`` (exact head, integral tail)."""
    _check_zipf(rows, exponent)
    head = min(rows, _HEAD)
    total = math.fsum(i**-exponent for i in range(1, head + 1))
    if rows > head:
        a, b = head + 0.5, rows + 0.5
        total += math.log(b / a) if exponent == 1 else (b ** (1 - exponent) - a ** (1 - exponent)) / (1 - exponent)
    return total


@lru_cache(maxsize=65536)
def expected_distinct(rows: int, draws: float, exponent: float) -> float:
    """Expected distinct rows among ``draws`` i.i.d. Zipf(``exponent``) ids over ``rows`` rows (module docstring)."""
    _check_zipf(rows, exponent)
    if draws < 0 or not math.isfinite(draws):
        raise ValueError(f"draws={draws!r} must be a finite number >= 0.")
    if draws == 0:
        return 0.0
    norm = zipf_normalizer(rows, exponent)
    head = min(rows, _HEAD)
    total = math.fsum(-math.expm1(draws * math.log1p(-(i**-exponent) / norm)) for i in range(1, head + 1))
    if rows > head:
        total += _tail_integral(lambda x: -math.expm1(-draws * x**-exponent / norm), head + 0.5, rows + 0.5)
    return min(float(rows), total)


def hot_row_share(rows: int, exponent: float, hot_fraction: float = 0.01) -> float:
    """Share of Zipf lookups that hit the hottest ``hot_fraction`` of the rows."""
    _check_zipf(rows, exponent)
    if not 0 < hot_fraction <= 1:
        raise ValueError(f"hot_fraction={hot_fraction} must be in (0, 1].")
    return zipf_normalizer(max(1, math.ceil(hot_fraction * rows)), exponent) / zipf_normalizer(rows, exponent)


def zipf_exponent_for_hot_share(rows: int, share: float, hot_fraction: float = 0.01) -> float:
    """The Zipf exponent whose hottest ``hot_fraction`` of ``rows`` rows gets ``share`` of the lookups (bisection)."""
    uniform = hot_row_share(rows, 0.0, hot_fraction)
    if not uniform <= share < 1:
        raise ValueError(
            f"hot_row_share={share} must be in [{uniform:.4g}, 1): the hottest {hot_fraction:.0%} of {rows} rows get at least "
            "their share of uniform lookups."
        )
    lo, hi = 0.0, 4.0
    if hot_row_share(rows, hi, hot_fraction) <= share:
        return hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if hot_row_share(rows, mid, hot_fraction) < share else (lo, mid)
    return (lo + hi) / 2


def zipf_exponent_for_distinct(rows: int, draws: int, distinct: int) -> float:
    """The Zipf exponent under which ``draws`` ids over ``rows`` rows are expected to hit ``distinct`` rows (bisection).

    This fits the quantity the sync traffic depends on (the union of touched rows) from a sample of
    any size; a hot-row share measured on a sample with fewer lookups than hot rows is near 1 for any
    distribution.
    """
    if not 1 <= distinct <= draws:
        raise ValueError(f"distinct={distinct} must be in [1, draws={draws}] (distinct rows among the sampled lookups).")
    lo, hi = 0.0, 4.0
    if expected_distinct(rows, draws, lo) <= distinct:
        return lo  # as spread as uniform ids (or more): the least skew the model has
    if expected_distinct(rows, draws, hi) >= distinct:
        return hi
    for _ in range(40):  # expected_distinct falls as the exponent grows
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_distinct(rows, draws, mid) > distinct else (lo, mid)
    return (lo + hi) / 2


# --------------------------------------------------------------------------- workload and layout
@dataclass(frozen=True, kw_only=True)
class Feature:
    """``tables`` equal tables of ``rows`` x ``dim``, each looked up by one feature with ``ids_per_example`` ids.

    ``pooled``: an ``EmbeddingBagCollection`` feature (ids_per_example = pooling factor); False: an
    ``EmbeddingCollection`` (sequence) feature (ids_per_example = sequence length). ``touched_fraction``,
    when given (e.g. measured), replaces the Zipf estimate: the fraction of a table's rows in the
    union of one sync interval of the modelled job.
    """

    name: str
    rows: int
    dim: int
    ids_per_example: float
    tables: int = 1
    pooled: bool = True
    zipf_exponent: float = 1.05
    touched_fraction: float | None = None

    def __post_init__(self) -> None:
        for name in ("rows", "dim", "tables"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Feature({self.name!r}).{name}={value!r} must be an integer >= 1.")
        if not self.ids_per_example > 0:
            raise ValueError(f"Feature({self.name!r}).ids_per_example={self.ids_per_example!r} must be > 0.")
        _check_zipf(self.rows, self.zipf_exponent)
        if self.touched_fraction is not None and not 0 <= self.touched_fraction <= 1:
            raise ValueError(f"Feature({self.name!r}).touched_fraction={self.touched_fraction!r} must be in [0, 1].")

    def distinct(self, draws: float) -> float:
        """Rows of one table touched by ``draws`` ids."""
        if self.touched_fraction is not None:
            return self.touched_fraction * self.rows
        return expected_distinct(self.rows, draws, self.zipf_exponent)


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What one rank trains per step: its batch, the embedding features, the dense parameters."""

    name: str
    batch_per_rank: int
    features: tuple[Feature, ...]
    dense_param_bytes: float
    optimizer_state_per_row: float = 1.0  # floats per row synced with the weights (row-wise Adagrad: 1; SGD: 0)
    id_bytes: int = 8
    length_bytes: int = 8
    compute_s: float | None = None  # per step, when known or stated
    note: str = ""

    def __post_init__(self) -> None:
        if self.batch_per_rank < 1 or not self.features:
            raise ValueError(f"ModelShape({self.name!r}) needs batch_per_rank >= 1 and at least one feature.")
        if self.dense_param_bytes < 0 or self.optimizer_state_per_row < 0:
            raise ValueError(f"ModelShape({self.name!r}): dense_param_bytes and optimizer_state_per_row must be >= 0.")
        if self.compute_s is not None and self.compute_s < 0:
            raise ValueError(f"ModelShape({self.name!r}).compute_s={self.compute_s} must be >= 0.")


@dataclass(frozen=True, kw_only=True)
class StrategyChoice:
    """1D (``sharding_group_size=None``) or 2D; QComms precisions of the embedding all-to-all; the sync."""

    sharding_group_size: int | None = None
    layout: str = "all_to_all_optimized"
    forward: str = "fp32"
    backward: str = "fp32"
    sync: ReplicaSyncConfig = field(default_factory=ReplicaSyncConfig)
    index_dedup: bool = False  # TorchRec's EmbeddingCollectionSharder(use_index_dedup=True) on sequence features

    def __post_init__(self) -> None:
        if not isinstance(self.index_dedup, bool):
            raise ValueError(f"StrategyChoice.index_dedup={self.index_dedup!r} must be True or False.")
        if self.layout not in LAYOUTS:
            raise ValueError(f"StrategyChoice.layout={self.layout!r} is not one of {list(LAYOUTS)}.")
        row_bytes(1, self.forward), row_bytes(1, self.backward)  # validates both

    @property
    def is_2d(self) -> bool:
        return self.sharding_group_size is not None

    def describe(self) -> str:
        comms = self.forward if self.forward == self.backward else f"{self.forward} fwd/{self.backward} bwd"
        if self.index_dedup:
            comms += " deduped"
        if not self.is_2d:
            return f"1D, {comms} all-to-all"
        short = "a2a-opt" if self.layout == "all_to_all_optimized" else "ar-opt"
        return f"2D {short}, {comms} all-to-all, sync {self.sync.describe()}"


# --------------------------------------------------------------------------- traffic
def ids_sent_per_rank(feature: Feature, batch_per_rank: int, *, index_dedup: bool) -> float:
    """Ids of one of ``feature``'s tables that one rank sends through the sequence all-to-all per step.

    With ``index_dedup`` (sequence features only) the expected distinct ids of the rank's own batch,
    ``D(N, s, b L)`` (module docstring); else every id, ``b L``. A stated ``touched_fraction``
    describes a sync interval's union, not one rank's batch, so the Zipf estimate is used here.
    """
    sent_ids = getattr(feature, "sent_ids", None)  # a feature of several parts (pretrain_traffic.PretrainItemFeature)
    if sent_ids is not None:
        return sent_ids(batch_per_rank, index_dedup=index_dedup)
    draws = batch_per_rank * feature.ids_per_example
    if not index_dedup or feature.pooled:
        return draws
    return expected_distinct(feature.rows, draws, feature.zipf_exponent)


def kjt_features(feature: Feature) -> int:
    """KJT features (one length per example each) that look ``feature``'s table up: 3 for a pretrainer's item table."""
    return 3 if hasattr(feature, "sent_ids") else 1


def sync_rows_per_rank(shape: ModelShape, topology: ParallelTopology, every_n_steps: int) -> float:
    """Expected rows of one rank's shards in the union over its replica group, per sync (symmetric ranks)."""
    draws_per_id = every_n_steps * shape.batch_per_rank * topology.world_size
    return sum(f.tables * f.distinct(draws_per_id * f.ids_per_example) for f in shape.features) / topology.sharding_group_size


def workload_traffic(
    shape: ModelShape, layout: StrategyChoice, topology: ParallelTopology, *, staged_dense: bool = False
) -> list[Collective]:
    """Per-rank, per-step collectives of ``shape`` trained with ``layout`` on ``topology`` (module docstring).

    ``staged_dense``: the dense all-reduce runs in two stages where the strategy stages it (gloo, 2D across nodes).
    """
    if layout.is_2d == topology.is_1d:
        raise ValueError(f"layout {layout.describe()!r} does not match the topology (1D: {topology.is_1d}).")
    b = shape.batch_per_rank
    sent = [(f, ids_sent_per_rank(f, b, index_dedup=layout.index_dedup)) for f in shape.features]
    ids = sum(f.tables * (n * shape.id_bytes + b * kjt_features(f) * shape.length_bytes) for f, n in sent)
    vectors = sum(f.tables * (b if f.pooled else n) * (row_bytes(f.dim, layout.forward) + row_bytes(f.dim, layout.backward))
                  for f, n in sent)  # fmt: skip
    out = [
        Collective(purpose="sparse_ids", op="all_to_all", group="shard", calls=3, payload_bytes=ids),
        Collective(purpose="embeddings", op="all_to_all", group="shard", calls=2, payload_bytes=vectors),
    ]
    staged = staged_dense and layout.is_2d and topology.spans_nodes(list(range(topology.world_size)))
    dense_groups = ("shard", "replicate") if staged else ("world",)
    out += [Collective(purpose="dense_grads", op="all_reduce", group=g, calls=1, payload_bytes=shape.dense_param_bytes) for g in dense_groups]
    if layout.is_2d:
        out += replica_sync_traffic(shape, layout.sync, topology)
    return out


def replica_sync_traffic(shape: ModelShape, sync: ReplicaSyncConfig, topology: ParallelTopology) -> list[Collective]:
    """The replica sync's collectives per rank and step (amortized over ``every_n_steps``)."""
    k, g = sync.every_n_steps, topology.sharding_group_size
    state = shape.optimizer_state_per_row if sync.optimizer_state else 0.0
    if sync.rows == "all":
        shard = sum(f.tables * f.rows * (f.dim + state) * 4 for f in shape.features) / g
        return [Collective(purpose="replica_sync", op="all_reduce", group="replicate", calls=1 / k, payload_bytes=shard / k)]
    own_draws = k * shape.batch_per_rank * g
    if sync.exchange == "all_gather":
        sent = sum(
            f.tables * f.distinct(own_draws * f.ids_per_example) * (4 + change_bytes_per_row(f.dim, sync.precision) + 4 * state)
            for f in shape.features
        ) / g
        counts = 8.0 * sum(f.tables for f in shape.features) / g
        return [Collective(purpose="replica_sync", op="all_gather", group="replicate", calls=2 / k, payload_bytes=(sent + counts) / k)]
    value = SYNC_VALUE_BYTES[sync.precision]
    draws = k * shape.batch_per_rank * topology.world_size
    union = sum(f.tables * f.distinct(draws * f.ids_per_example) * (f.dim + state) * value for f in shape.features) / g
    own_rows = sum(f.tables * f.distinct(own_draws * f.ids_per_example) for f in shape.features) / g
    local_rows = sum(f.tables * f.rows for f in shape.features) / g
    agree = min(4.0 * own_rows, local_rows / 8)  # int32 ids or a 1-bit mask, whichever is smaller
    return [
        Collective(purpose="replica_sync", op="all_reduce", group="replicate", calls=2 / k, payload_bytes=(union + 8) / k),
        Collective(purpose="replica_sync", op="all_gather", group="replicate", calls=1 / k, payload_bytes=agree / k),
    ]


def overlapped_purposes(layout: StrategyChoice, *, dense_grads: bool = True) -> tuple[str, ...]:
    """Purposes hidden behind compute: DDP's all-reduce (GPUs overlap it with backward), an overlapped sync."""
    out = ("dense_grads",) if dense_grads else ()
    if layout.is_2d and layout.sync.overlap:
        out += ("replica_sync",)
    return out
