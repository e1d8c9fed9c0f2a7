"""The cost model's view of an emulated-cluster run: a prediction per configuration before it, and after
it the prediction beside the measured steps and ratios (the sequence workload's targets).

Bytes come from ``lightning_recsys.planner.cost.traffic_model`` (the workload's ``ModelShape``; index
dedup's expected unique ids from the Zipf union formula), time from ``cost_model.step_time`` on the
emulated link (TBF rate, delay, bucket; the loopback inside a node is free). Before the run the
compute per step is an assumption (``--predict-compute-ms``); after it, each configuration's own
measured unshaped step, as ``benchmarks/cost_model.py`` validates the pooled run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from emulated.configs import NODES, RANKS_PER_NODE, TWO_D_TARGET, BenchConfig

from lightning_recsys.parallel.sync import ReplicaSyncConfig
from lightning_recsys.planner.cost import Cluster, Link, ModelShape, StepEstimate, StrategyChoice, step_time, topology_for, workload_traffic
from lightning_recsys.planner.cost.traffic_model import ids_sent_per_rank, overlapped_purposes

TOLERANCE = 0.25  # the cost model's validated error
_PRECISIONS = {"fp32": ("fp32", "fp32"), "bf16": ("bf16", "bf16"), "fp16": ("fp16", "fp16"), "fp8": ("fp8", "fp8"),
               "int8": ("int8", "bf16"), "fp8_fwd_bf16_bwd": ("fp8", "bf16")}  # fmt: skip


def emulated_link_cluster(bandwidth_mbit: float, latency_ms: float, mtu: int) -> Cluster:
    """The emulated cluster as the cost model sees it (the TBF bucket as ``network.build_cluster`` sets it)."""
    inter = Link(bandwidth_bytes_per_s=bandwidth_mbit * 1e6 / 8, latency_s=latency_ms * 1e-3, burst_bytes=mtu + 1514)
    return Cluster(nodes=NODES, ranks_per_node=RANKS_PER_NODE, intra=Link.free(), inter=inter)


def layout_of(cfg: BenchConfig) -> StrategyChoice:
    forward, backward = _PRECISIONS[cfg.qcomms]
    sync = ReplicaSyncConfig(rows=cfg.sync_rows, every_n_steps=cfg.sync_every_n_steps, overlap=cfg.sync_overlap,  # type: ignore[arg-type]
                             precision=cfg.sync_precision, exchange=cfg.sync_exchange)  # type: ignore[arg-type]  # fmt: skip
    group = cfg.sharding_group_size if cfg.is_2d else None
    return StrategyChoice(sharding_group_size=group, layout=cfg.layout, forward=forward, backward=backward, sync=sync,
                          index_dedup=cfg.index_dedup)  # fmt: skip


def predict(shape: ModelShape, cfg: BenchConfig, cluster: Cluster, compute_s: float) -> StepEstimate:
    layout = layout_of(cfg)
    topology = topology_for(cluster, layout.sharding_group_size, layout.layout)
    collectives = workload_traffic(shape, layout, topology, staged_dense=True)  # gloo: the 2D dense all-reduce is staged
    return step_time(collectives, topology, cluster, compute_s, overlapped=overlapped_purposes(layout, dense_grads=False))


def best_2d(shape: ModelShape, candidates: list[BenchConfig], cluster: Cluster, compute_s: float) -> BenchConfig:
    """The 2D candidate whose predicted step is shortest; among equal steps (an overlapped sync hidden behind the
    compute) the one sending the fewest bytes across nodes, which stays ahead if the compute is shorter than assumed."""
    def rank(c: BenchConfig) -> tuple[float, float]:
        e = predict(shape, c, cluster, compute_s)
        return round(e.step_s, 6), e.inter_node_bytes

    return min(candidates, key=rank)


def unique_fraction(shape: ModelShape, feature: str) -> float:
    """The model's fraction of one rank's ids of ``feature`` that index dedup keeps."""
    f = next(f for f in shape.features if f.name == feature)
    return ids_sent_per_rank(f, shape.batch_per_rank, index_dedup=True) / (shape.batch_per_rank * f.ids_per_example)


def print_prediction(shape: ModelShape, configs: list[BenchConfig], cluster: Cluster, compute_s: float) -> dict[str, Any]:
    """Before the run: each configuration's predicted bytes, network time and step on this link."""
    print(f"\nCost model, before the run (compute assumed {compute_s * 1e3:.0f} ms per step; link "
          f"{cluster.inter.bandwidth_bytes_per_s * 8 / 1e6:g} Mbit/s, {cluster.inter.latency_s * 1e3:g} ms one-way; "
          f"index dedup keeps {unique_fraction(shape, 'item'):.0%} of a rank's item ids):\n")  # fmt: skip
    print("| configuration | predicted inter-node MB/step per node | predicted network ms | predicted step ms |\n|---|---|---|---|")
    out = {}
    for cfg in configs:
        e = predict(shape, cfg, cluster, compute_s)
        out[cfg.name] = {"step_s": e.step_s, "comm_s": e.comm_s, "inter_node_bytes_per_node": e.inter_node_bytes}
        print(f"| {cfg.label} | {e.inter_node_bytes / 1e6:.2f} | {e.comm_s * 1e3:.1f} | {e.step_s * 1e3:.0f} |")
    ratios = _ratios({c.name: out[c.name]["step_s"] for c in configs}, configs)
    if ratios:
        print(f"\nPredicted: best 2D / best 1D = {ratios['two_d_vs_one_d']:.2f} (target <= {TWO_D_TARGET}).")
    return {"compute_s": compute_s, "configs": out, "ratios": ratios}


def _ratios(steps: dict[str, float], configs: list[BenchConfig]) -> dict[str, Any]:
    one_d = [c for c in configs if not c.is_2d and c.name in steps]
    two_d = [c for c in configs if c.is_2d and c.name in steps]
    if not one_d or not two_d:
        return {}
    b1, b2 = min(one_d, key=lambda c: steps[c.name]), min(two_d, key=lambda c: steps[c.name])
    return {"best_1d": b1.name, "best_2d": b2.name, "two_d_vs_one_d": steps[b2.name] / steps[b1.name]}


@dataclass(frozen=True)
class Comparison:
    config: str
    label: str
    unshaped_s: float
    measured_s: float
    predicted_s: float

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1.0


def compare(shape: ModelShape, rows: list[Any], cluster: Cluster) -> list[Comparison]:
    """After the run: each configuration's predicted cluster step with its own measured unshaped step as the compute."""
    return [Comparison(r.cfg.name, r.cfg.label, r.reference["step_time_s"], r.cluster["step_time_s"],
                       predict(shape, r.cfg, cluster, r.reference["step_time_s"]).step_s) for r in rows]  # fmt: skip


def print_comparison(shape: ModelShape, rows: list[Any], cluster: Cluster, before: dict[str, Any]) -> dict[str, Any]:
    """The prediction beside the measurement, per configuration and for the targets' ratios."""
    comparisons = compare(shape, rows, cluster)
    print("\nCost model vs measured (compute = the configuration's own measured unshaped step):\n")
    print("| configuration | unshaped ms | measured cluster ms | predicted cluster ms | error | measured unique item ids (rank 0) |")
    print("|---|---|---|---|---|---|")
    for c, r in zip(comparisons, rows):
        unique = r.cluster.get("unique_id_fraction_rank0", {}).get("item")
        print(f"| {c.label} | {c.unshaped_s * 1e3:.0f} | {c.measured_s * 1e3:.0f} | {c.predicted_s * 1e3:.0f} | {c.error:+.0%} | "
              f"{'-' if unique is None else f'{unique:.0%}'} |")  # fmt: skip
    configs = [r.cfg for r in rows]
    measured = _ratios({r.cfg.name: r.cluster["step_time_s"] for r in rows}, configs)
    predicted = _ratios({c.config: c.predicted_s for c in comparisons}, configs)
    within = all(abs(c.error) <= TOLERANCE for c in comparisons)
    worst = max(comparisons, key=lambda c: abs(c.error))
    print(f"\nCost model within {TOLERANCE:.0%} on every configuration: {'YES' if within else 'NO'} "
          f"(largest error {worst.error:+.0%}, {worst.config}).")  # fmt: skip
    if measured:
        print(f"Best 2D / best 1D cluster step: measured {measured['two_d_vs_one_d']:.2f} ({measured['best_2d']} / {measured['best_1d']}), "
              f"predicted {predicted['two_d_vs_one_d']:.2f} after the run, {before.get('ratios', {}).get('two_d_vs_one_d', float('nan')):.2f} "
              f"before it; target <= {TWO_D_TARGET}: {'MET' if measured['two_d_vs_one_d'] <= TWO_D_TARGET else 'MISSED'}.")  # fmt: skip
    return {
        "before": before, "measured_ratios": measured, "predicted_ratios": predicted, "model_within_tolerance": within,
        "per_config": [{"config": c.config, "unshaped_s": c.unshaped_s, "measured_s": c.measured_s, "predicted_s": c.predicted_s,
                        "error": c.error} for c in comparisons],
        "two_d_target_met": bool(measured) and measured["two_d_vs_one_d"] <= TWO_D_TARGET,
    }  # fmt: skip


def print_repeats(shape: ModelShape, runs: dict[tuple[str, str], list[dict[str, Any]]], configs: list[BenchConfig],
                  cluster: Cluster) -> dict[str, Any]:  # fmt: skip
    """Each repeat on its own (its cluster run against its own unshaped run): the prediction beside the measurement,
    inter-node MB per step per node, best 2D / best 1D, and in how many repeats each statement held."""
    done = [c for c in configs if runs.get((c.name, "cluster")) and runs.get((c.name, "reference"))]
    repeats = min((min(len(runs[(c.name, "cluster")]), len(runs[(c.name, "reference")])) for c in done), default=0)
    if not repeats:
        return {}
    print(f"\nPer repeat ({repeats}): predicted with that repeat's own unshaped step as the compute; inter-node MB per step and "
          f"node (measured: rank 0's x {RANKS_PER_NODE}, ranks are symmetric)\n")  # fmt: skip
    print("| repeat | configuration | unshaped ms | measured ms | predicted ms | error | inter-node MB measured | predicted |")
    print("|---|---|---|---|---|---|---|---|")
    per_repeat = []
    for i in range(repeats):
        measured_steps, predicted_steps, errors, inter = {}, {}, {}, {}
        for c in done:
            cl, ref = runs[(c.name, "cluster")][i], runs[(c.name, "reference")][i]
            estimate = predict(shape, c, cluster, ref["step_time_s"])
            measured_steps[c.name], predicted_steps[c.name] = cl["step_time_s"], estimate.step_s
            errors[c.name] = estimate.step_s / cl["step_time_s"] - 1
            inter[c.name] = (cl["bytes_per_step_rank0"]["inter_node"] * RANKS_PER_NODE, estimate.inter_node_bytes)
            print(f"| {i + 1} | {c.label} | {ref['step_time_s'] * 1e3:.0f} | {cl['step_time_s'] * 1e3:.0f} | {estimate.step_s * 1e3:.0f} | "
                  f"{errors[c.name]:+.0%} | {inter[c.name][0] / 1e6:.2f} | {inter[c.name][1] / 1e6:.2f} |")  # fmt: skip
        measured, predicted = _ratios(measured_steps, done), _ratios(predicted_steps, done)
        per_repeat.append({
            "errors": errors, "inter_node_bytes_per_node": inter, "measured_ratios": measured, "predicted_ratios": predicted,
            "model_within_tolerance": all(abs(e) <= TOLERANCE for e in errors.values()),
            "bytes_within_tolerance": all(abs(p / m - 1) <= TOLERANCE for m, p in inter.values() if m),
            "two_d_faster": bool(measured) and measured["two_d_vs_one_d"] < 1.0,
            "two_d_target_met": bool(measured) and measured["two_d_vs_one_d"] <= TWO_D_TARGET,
            "same_winner": bool(measured) and (measured["two_d_vs_one_d"] < 1.0) == (predicted["two_d_vs_one_d"] < 1.0),
        })  # fmt: skip
    print()
    for i, r in enumerate(per_repeat):
        if r["measured_ratios"]:
            m, p = r["measured_ratios"], r["predicted_ratios"]
            print(f"Repeat {i + 1}: best 2D / best 1D = {m['two_d_vs_one_d']:.2f} measured ({m['best_2d']} / {m['best_1d']}), "
                  f"{p['two_d_vs_one_d']:.2f} predicted.")  # fmt: skip
    statements = {
        "model_within_tolerance": f"the cost model's step within {TOLERANCE:.0%} on every configuration",
        "bytes_within_tolerance": f"the predicted inter-node bytes within {TOLERANCE:.0%} of the measured on every configuration",
        "two_d_faster": "the best 2D faster than the best 1D",
        "two_d_target_met": f"best 2D / best 1D <= {TWO_D_TARGET}",
        "same_winner": "the cost model picks the measured winner (1D or 2D)",
    }
    held = {key: sum(r[key] for r in per_repeat) for key in statements}
    for key, text in statements.items():
        print(f"- {text}: held in {held[key]} of {repeats} repeats")
    return {"repeats": repeats, "per_repeat": per_repeat, "held": held}
