"""Which layout to train with: the cost model's projection of every candidate, the best one, and how sure it is.

Trainer-free (no Lightning imports). For a ``ModelShape`` (``traffic_model``) on ``nodes`` nodes of
``Hardware``, every candidate ``StrategyChoice`` (1D with FP32 / BF16 / FP8 all-to-all; 2D all-to-all
optimized with touched-row or whole-shard sync every 1-16 steps, blocking or overlapped, fp32 or
bf16 deltas; for a workload with sequence features each of them also with TorchRec's index dedup,
so 2D is compared against the best 1D a TorchRec user would run) gets a step time from ``cost_model.step_time``. Scaling is weak scaling against **one**
common baseline, the fastest one-node step of any candidate (on one node 2D is 1D: the sharding
group is the node). Overlapped collectives (DDP's all-reduce, an overlapped sync) cost only what
exceeds the compute time.

``recommend`` says how sure it is by re-deciding under perturbed assumptions: compute time x0.5 and
x2, Zipf exponent -0.2 / +0.2 (a larger or smaller union of touched rows), inter-node bandwidth x0.5
and x2. "high": the pick (1D or 2D) holds in every perturbation and beats the best of the other
kind by more than the model's validated error (25%); "medium": it holds in at least 2/3 of them;
"low" otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from lightning_recsys.parallel.sync import ReplicaSyncConfig
from lightning_recsys.planner.cost.cost_model import Cluster, Link, StepEstimate, step_time, topology_for
from lightning_recsys.planner.cost.traffic_model import Feature, ModelShape, StrategyChoice, overlapped_purposes, workload_traffic

MODEL_TOLERANCE = 0.25  # the cost model's validated error on the emulated cluster
TARGET_SCALING = 7.5
TIE = 0.05  # steps closer than this count as a tie
INTERVALS: tuple[int, ...] = (1, 2, 4, 8, 16)


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """Nodes of ``gpus_per_node`` GPUs: NVLink-class links inside a node, one shared uplink per node."""

    gpus_per_node: int = 8
    intra_gbyte_s: float = 300.0  # per GPU per direction (A100 NVLink 3: 600 GB/s both ways)
    intra_latency_us: float = 5.0
    inter_gbit_s: float = 400.0  # per node (p4d-class: 4 x 100 Gb/s EFA)
    inter_latency_us: float = 20.0

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.intra_gbyte_s <= 0 or self.inter_gbit_s <= 0:
            raise ValueError(f"Hardware({self}) needs gpus_per_node >= 1 and positive bandwidths.")

    def cluster(self, nodes: int) -> Cluster:
        return Cluster(
            nodes=nodes,
            ranks_per_node=self.gpus_per_node,
            intra=Link(bandwidth_bytes_per_s=self.intra_gbyte_s * 1e9, latency_s=self.intra_latency_us * 1e-6),
            inter=Link.gbit(self.inter_gbit_s, self.inter_latency_us),
        )


def parse_cluster(text: str) -> tuple[int, int, float | None]:
    """``"NODESxGPUS"`` or ``"NODESxGPUS@GBIT"`` (per-node uplink in Gbit/s) -> (nodes, gpus per node, Gbit/s or None)."""
    spec, _, gbit = text.strip().lower().partition("@")
    nodes, sep, gpus = spec.partition("x")
    try:
        n, g = int(nodes), int(gpus)
        bandwidth = float(gbit) if gbit else None
    except ValueError:
        n = g = 0
        bandwidth = None
    if not sep or n < 1 or g < 1 or (bandwidth is not None and not bandwidth > 0):
        raise ValueError(f"--cluster {text!r} must look like NODESxGPUS, e.g. 8x8, or 8x8@400 for a 400 Gbit/s uplink per node.")
    return n, g, bandwidth


def candidate_layouts(intervals: Iterable[int] = INTERVALS, *, index_dedup: bool = True) -> list[StrategyChoice]:
    """1D at three all-to-all precisions; 2D all-to-all optimized with every sync mode and interval; with
    ``index_dedup`` each of them also with TorchRec's sequence index dedup (a no-op on pooled-only shapes,
    where the tie-break keeps the variant without it)."""
    out = [StrategyChoice(), StrategyChoice(forward="bf16", backward="bf16"), StrategyChoice(forward="fp8", backward="bf16")]
    for k in intervals:
        out.append(StrategyChoice(sharding_group_size=0, sync=ReplicaSyncConfig(rows="all", every_n_steps=k)))
        for overlap in (False, True):
            for precision, exchange in (("fp32", "all_reduce"), ("bf16", "all_reduce"), ("bf16", "all_gather"), ("fp8", "all_gather")):
                sync = ReplicaSyncConfig(rows="touched", every_n_steps=k, overlap=overlap, precision=precision, exchange=exchange)  # type: ignore[arg-type]
                out.append(StrategyChoice(sharding_group_size=0, sync=sync))
    if index_dedup:
        out += [replace(layout, index_dedup=True) for layout in out]
    return out  # sharding_group_size=0 stands for "one group per node", resolved per cluster


def has_sequence_features(shape: ModelShape) -> bool:
    """Whether index dedup can change ``shape``'s traffic (only ``EmbeddingCollection`` features have it)."""
    return any(not f.pooled for f in shape.features)


@dataclass(frozen=True)
class Projection:
    layout: StrategyChoice
    nodes: int
    step_s: float
    baseline_step_s: float  # the fastest one-node step of any candidate
    estimate: StepEstimate

    @property
    def scaling(self) -> float:
        return self.nodes * self.baseline_step_s / self.step_s


def _estimate(shape: ModelShape, layout: StrategyChoice, hardware: Hardware, nodes: int, compute_s: float) -> StepEstimate:
    cluster = hardware.cluster(nodes)
    two_d = layout.is_2d and nodes > 1  # one node: the sharding group is the node, i.e. 1D
    topology = topology_for(cluster, hardware.gpus_per_node if two_d else None, layout.layout)
    resolved = replace(layout, sharding_group_size=hardware.gpus_per_node if two_d else None)
    collectives = workload_traffic(shape, resolved, topology)
    return step_time(collectives, topology, cluster, compute_s, overlapped=overlapped_purposes(resolved))


def _compute(shape: ModelShape, compute_s: float | None) -> float:
    value = shape.compute_s if compute_s is None else compute_s
    if value is None:
        raise ValueError(f"ModelShape({shape.name!r}) states no compute time per step; pass compute_s.")
    return value


def baseline_step(shape: ModelShape, layouts: Sequence[StrategyChoice], hardware: Hardware, compute_s: float) -> float:
    """The fastest one-node step of any of ``layouts``: the one baseline scaling is measured against."""
    return min(_estimate(shape, layout, hardware, 1, compute_s).step_s for layout in layouts)


def project(
    shape: ModelShape,
    layouts: Sequence[StrategyChoice],
    hardware: Hardware,
    nodes: int,
    compute_s: float | None = None,
    *,
    baseline_layouts: Sequence[StrategyChoice] | None = None,
) -> list[Projection]:
    """Every layout's step and scaling on ``nodes`` nodes, best first; the baseline is the fastest one-node
    step of ``baseline_layouts`` (default: ``layouts``)."""
    compute = _compute(shape, compute_s)
    baseline = baseline_step(shape, baseline_layouts or layouts, hardware, compute)
    out = [Projection(layout, nodes, (e := _estimate(shape, layout, hardware, nodes, compute)).step_s, baseline, e) for layout in layouts]
    return sorted(out, key=lambda p: (p.step_s, _complexity(p.layout)))


def _complexity(layout: StrategyChoice) -> tuple[int, ...]:
    """Among equal steps prefer the simpler setting: 1D, then fewer features on, then the shorter interval."""
    if not layout.is_2d:
        return (0, (layout.forward != "fp32") + layout.index_dedup)
    s = layout.sync
    return (1, s.overlap + (s.precision != "fp32") + layout.index_dedup, s.every_n_steps)


def compute_for_scaling(
    shape: ModelShape, layout: StrategyChoice, hardware: Hardware, nodes: int, target: float, layouts: Sequence[StrategyChoice]
) -> float | None:
    """The compute time per step at which ``layout`` reaches ``target`` scaling (None: not below 10 s)."""
    def scaling(c: float) -> float:
        return nodes * baseline_step(shape, layouts, hardware, c) / _estimate(shape, layout, hardware, nodes, c).step_s

    lo, hi = 0.0, 10.0
    if scaling(hi) < target:
        return None
    if scaling(lo) >= target:
        return 0.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if scaling(mid) < target else (lo, mid)
    return hi


@dataclass(frozen=True)
class Advice:
    best: Projection
    best_other_kind: Projection  # the best 1D when the pick is 2D, and the reverse
    runner_ups: tuple[Projection, ...]
    confidence: str
    agreeing: int
    perturbations: int
    reasons: tuple[str, ...]

    @property
    def margin(self) -> float:
        """How much faster the pick's step is than the best of the other kind (0.3 = 30%)."""
        return self.best_other_kind.step_s / self.best.step_s - 1.0

    def lines(self) -> list[str]:
        b, o = self.best, self.best_other_kind
        kind = "2D" if b.layout.is_2d else "1D"
        out = [
            f"recommended: {b.layout.describe()}",
            f"  projected {b.scaling:.2f}x on {b.nodes} nodes ({b.step_s * 1e3:.1f} ms/step against {b.baseline_step_s * 1e3:.1f} ms on one node)",
            f"  best {'1D' if b.layout.is_2d else '2D'}: {o.layout.describe()}: {o.scaling:.2f}x ({o.step_s * 1e3:.1f} ms/step)",
            f"  confidence: {self.confidence} ({self.agreeing}/{self.perturbations} perturbed assumptions pick {kind}; "
            f"margin {self.margin:+.0%} against the model's {MODEL_TOLERANCE:.0%} error)",
        ]
        out += [f"  - {r}" for r in self.reasons]
        return out


def recommend(
    shape: ModelShape,
    hardware: Hardware,
    nodes: int,
    compute_s: float | None = None,
    *,
    max_interval: int = 4,
) -> Advice:
    """The best candidate with a sync interval <= ``max_interval``, the best of the other kind, and the confidence."""
    if nodes < 2:
        raise ValueError(f"nodes={nodes}: a layout choice needs at least 2 nodes (on one node 2D is 1D).")
    layouts = candidate_layouts((k for k in INTERVALS if k <= max_interval), index_dedup=has_sequence_features(shape))
    compute = _compute(shape, compute_s)
    ranked = project(shape, layouts, hardware, nodes, compute)
    best, other, tied = _pick(ranked)
    reasons = []
    if tied:
        reasons.append(f"2D is within {TIE:.0%} of 1D here; 1D needs less memory per GPU and no replica sync")
    cases = [
        (shape, hardware, compute * 0.5), (shape, hardware, compute * 2.0),
        (_shift_zipf(shape, -0.2), hardware, compute), (_shift_zipf(shape, +0.2), hardware, compute),
        (shape, replace(hardware, inter_gbit_s=hardware.inter_gbit_s * 0.5), compute),
        (shape, replace(hardware, inter_gbit_s=hardware.inter_gbit_s * 2.0), compute),
    ]  # fmt: skip
    # The same decision rule, ties included, under each perturbed assumption.
    agreeing = sum(_pick(project(s, layouts, h, nodes, c))[0].layout.is_2d == best.layout.is_2d for s, h, c in cases)
    margin = other.step_s / best.step_s - 1.0
    if agreeing == len(cases) and margin > MODEL_TOLERANCE:
        confidence = "high"
    elif agreeing >= math.ceil(2 * len(cases) / 3) and margin > TIE:
        confidence = "medium"
    else:
        confidence = "low"
    by_purpose = best.estimate.seconds_by_purpose()
    top = max(by_purpose, key=by_purpose.get) if by_purpose else None  # type: ignore[arg-type]
    if top is not None:
        reasons.append(f"largest collective of the pick: {top} ({by_purpose[top] * 1e3:.1f} ms/step, compute {compute * 1e3:.1f} ms)")
    if best.scaling < TARGET_SCALING:
        need = compute_for_scaling(shape, best.layout, hardware, nodes, TARGET_SCALING, layouts)
        reasons.append(
            f"{TARGET_SCALING}x on {nodes} nodes needs "
            + (f"about {need * 1e3:.0f} ms of compute per step" if need is not None else "more than 10 s of compute per step")
            + " with this layout"
        )
    return Advice(best, other, tuple(ranked[1:4]), confidence, agreeing, len(cases), tuple(reasons))


def _pick(ranked: list[Projection]) -> tuple[Projection, Projection, bool]:
    """The pick, the best of the other kind, and whether a tie moved the pick from 2D to 1D."""
    best = ranked[0]
    other = next(p for p in ranked if p.layout.is_2d != best.layout.is_2d)
    if best.layout.is_2d and other.step_s <= best.step_s * (1 + TIE):
        # A tie goes to 1D: less memory per GPU (no full replica per node) and no replica sync.
        return other, best, True
    return best, other, False


def _shift_zipf(shape: ModelShape, delta: float) -> ModelShape:
    features = tuple(replace(f, zipf_exponent=max(0.0, f.zipf_exponent + delta)) for f in shape.features)
    return replace(shape, features=features)


class TableProfile(NamedTuple):
    """What the advice knows of one table (from a plan report, or stated)."""

    name: str
    rows: int
    dim: int
    ids_per_example: float
    hot_row_share: float | None
    pooled: bool
    sampled: tuple[int, int] | None = None  # (lookups, distinct rows) that a profile counted


def shape_from_tables(
    name: str,
    tables: Sequence[TableProfile | tuple],
    *,
    batch_per_rank: int,
    dense_param_bytes: float,
    hot_fraction: float = 0.01,
    default_zipf: float = 1.05,
    compute_s: float | None = None,
) -> tuple[ModelShape, list[str]]:
    """A ``ModelShape`` from a planner profile (``TableProfile`` per table) and the assumptions made, to print.

    Each table's Zipf exponent is fitted to the profile's distinct rows among its lookups where
    there is a profile, else to a stated hot-row share, else ``default_zipf`` is assumed.
    """
    from lightning_recsys.planner.cost.traffic_model import zipf_exponent_for_distinct, zipf_exponent_for_hot_share

    features, unknown, fitted = [], [], []
    for entry in tables:
        t = TableProfile(*entry)
        if t.sampled is not None and t.rows > 1:
            exponent = zipf_exponent_for_distinct(t.rows, *t.sampled)
            fitted.append(exponent)
        elif t.hot_row_share is not None and t.rows > 1 and t.hot_row_share > hot_fraction:
            exponent = zipf_exponent_for_hot_share(t.rows, min(t.hot_row_share, 0.999999), hot_fraction)
        else:
            exponent = default_zipf
            unknown.append(t.name)
        features.append(Feature(name=t.name, rows=t.rows, dim=t.dim, ids_per_example=t.ids_per_example, pooled=t.pooled,
                                zipf_exponent=exponent))  # fmt: skip
    assumed = [f"no hot-row share for {len(unknown)} table(s) ({', '.join(unknown[:4])}{', ...' if len(unknown) > 4 else ''}): "
               f"Zipf exponent {default_zipf:g} assumed"] if unknown else []  # fmt: skip
    if fitted:
        assumed.append(
            f"Zipf exponents {min(fitted):.2f}-{max(fitted):.2f} fitted to the distinct rows the profile's lookups hit "
            f"({len(fitted)} table(s)); ids assumed independent from step to step"
        )
    return ModelShape(name=name, batch_per_rank=batch_per_rank, features=tuple(features), dense_param_bytes=dense_param_bytes,
                      compute_s=compute_s), assumed  # fmt: skip


DEFAULT_COMPUTE_MS = 20.0  # assumed when the user states none


def model_profile(model: object) -> tuple[float, set[str]]:
    """(dense parameter bytes, names of sequence tables) of a ranker: parameters outside its embedding
    modules, and the tables of its ``EmbeddingCollection`` modules."""
    from torchrec import EmbeddingBagCollection, EmbeddingCollection

    embedding_params: set[int] = set()
    sequence: set[str] = set()
    for module in model.modules():  # type: ignore[attr-defined]
        if isinstance(module, (EmbeddingBagCollection, EmbeddingCollection)):
            embedding_params.update(id(p) for p in module.parameters())
            if isinstance(module, EmbeddingCollection):
                sequence.update(config.name for config in module.embedding_configs())
    dense = sum(p.numel() * 4 for p in model.parameters() if id(p) not in embedding_params)  # type: ignore[attr-defined]
    return float(dense), sequence


def advise_from_report(report: object, model: object, cluster: str, compute_ms: float | None = None) -> list[str]:
    """``lightning-recsys plan --cluster``'s lines: the recommendation for the planned config on ``cluster``.

    ``report`` is a ``PlanReport`` (its tables' rows, dims, lookups per example and hot-row shares,
    profiled or assumed, and the batch per rank); ``model`` the ranker (dense size, sequence tables).
    """
    nodes, gpus, gbit = parse_cluster(cluster)
    if compute_ms is not None and not compute_ms > 0:
        raise ValueError(f"--compute-ms {compute_ms} must be > 0 (the model's compute time per step on one GPU).")
    hardware = Hardware(gpus_per_node=gpus, **({"inter_gbit_s": gbit} if gbit else {}))
    dense, sequence = model_profile(model)
    tables = [
        TableProfile(t.name, t.rows, t.dim, t.lookups_per_example, t.hot_row_share, t.name not in sequence,
                     None if t.sampled_lookups is None else (t.sampled_lookups, t.sampled_distinct_rows))
        for t in report.tables  # type: ignore[attr-defined]
    ]  # fmt: skip
    compute = (compute_ms if compute_ms is not None else DEFAULT_COMPUTE_MS) / 1e3
    shape, assumed = shape_from_tables(
        "planned", tables, batch_per_rank=report.batch_size, dense_param_bytes=dense, compute_s=compute  # type: ignore[attr-defined]
    )
    if compute_ms is None:
        assumed.insert(0, f"compute {DEFAULT_COMPUTE_MS:g} ms per step assumed (pass --compute-ms with a measured one-GPU step)")
    sources = sorted({getattr(t, "stats_source", "?") for t in report.tables})  # type: ignore[attr-defined]
    lines = [
        f"Layout advice (cost model) for {nodes} nodes x {gpus} GPUs, {hardware.inter_gbit_s:g} Gbit/s per node, "
        f"{hardware.intra_gbyte_s:g} GB/s per GPU inside a node; batch {report.batch_size} per GPU; "  # type: ignore[attr-defined]
        f"table stats: {', '.join(sources)}",
    ]
    if nodes < 2:
        return lines + ["  one node: 2D is 1D here (the sharding group is the node); nothing to choose."]
    advice = recommend(shape, hardware, nodes)
    lines += advice.lines()
    lines += [f"  assumption: {a}" for a in assumed]
    lines.append("  (a projection: the model's step times were within 25% of the emulated cluster's; check on your cluster)")
    return lines
