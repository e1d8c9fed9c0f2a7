"""Communication cost model: validated on the emulated cluster, then projected to 8-GPU nodes.

    python benchmarks/cost_model.py                       # reads benchmarks/results/emulated_cluster.json
    python benchmarks/cost_model.py --measured other.json --inter-gbit-s 200

Input: the JSON of ``emulated_cluster.py`` (per configuration: rank 0's bytes per step of every
collective from ``strategy.comm_accounting``, rank 0's rows per replica sync, the unshaped and
shaped step times, the tc settings). The model is ``lightning_recsys.planner.cost.cost_model`` (time),
``traffic_model`` (bytes, Zipf union of touched rows) and ``layout_advice`` (candidates, scaling).

1. **Bytes.** The analytic traffic (batch, tables, dims, precisions, group size, and for touched-row
   sync the expected union of Zipf ids) against the accounting's measured bytes per purpose, and
   the expected rows per sync against rank 0's measured rows per sync (target: within 25%).
   Nothing is fitted.
2. **Time.** Predicted network penalty = (unshaped step + modelled network time) / unshaped step,
   against the measured penalty. Fitted: only the compute time, the measured unshaped step of the
   same configuration. Given: the measured bytes, tc's rate, delay and TBF bucket. Target: 25%.
3. **Projection** (a model, not a measurement) of three workloads on 1-8 nodes of 8 GPUs,
   NVLink-class inside a node and a 400 Gb/s EFA-class uplink per node, with every candidate layout:
   today's projection workload (compute fitted, as before, to the published 1D FP32 1.21x on 4
   nodes), a Criteo-Terabyte-like one and a sequence-heavy foundation ranker (compute times stated).
   Every candidate also runs with TorchRec's sequence index dedup (``use_index_dedup=True``), so the
   best 1D is the deduped one wherever dedup helps, and 2D is compared against it.
4. **Regime map**: the best configuration and its 8-node scaling per workload, and as a function of
   pooling / sequence length, Zipf skew (touched fraction) and sync interval.
5. **Pretraining traffic** (``_pretrain_cost.py``): ``SequencePretrainer``'s ids per feature (history, targets,
   negatives), learned from sampled batches, against exact counts, with and without index dedup.
6. **Pretraining regime map**: ``layout_advice.recommend`` over tokens per example, skew and negatives.

Prints Markdown tables, writes JSON (default ``benchmarks/results/cost_model.json``) and, with
matplotlib, ``benchmarks/results/cost_model_projection.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from lightning_recsys.parallel.sync.replica_sync_config import ReplicaSyncConfig
from lightning_recsys.planner.cost.cost_model import Cluster, Link, collectives_from_accounting, network_penalty, step_time, topology_for
from lightning_recsys.planner.cost.layout_advice import (
    INTERVALS,
    TARGET_SCALING,
    TIE,
    Hardware,
    Projection,
    candidate_layouts,
    compute_for_scaling,
    project,
)
from lightning_recsys.planner.cost.traffic_model import (
    Feature,
    ModelShape,
    StrategyChoice,
    expected_distinct,
    overlapped_purposes,
    workload_traffic,
)

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TOLERANCE = 0.25
NODE_COUNTS = (1, 2, 4, 8)
# The published production account (Pinterest Engineering, June 2026): scaling against one node.
PUBLISHED = {"before": {4: 1.21}, "after": {4: 3.9, 8: 7.5}}
QCOMMS_PRECISIONS = {"fp32": ("fp32", "fp32"), "bf16": ("bf16", "bf16"), "fp16": ("fp16", "fp16"),
                     "fp8": ("fp8", "fp8"), "int8": ("int8", "bf16"), "fp8_fwd_bf16_bwd": ("fp8", "bf16")}  # fmt: skip
# MLPerf DLRM's Criteo Terabyte table sizes (ids capped at 4e7 per feature).
CRITEO_TB_ROWS = (39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10, 2208, 11938, 155, 4, 976,
                  14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36)  # fmt: skip


def workloads(zipf: float) -> dict[str, ModelShape]:
    """The projected workloads (per GPU). Compute times are stated assumptions, not measurements."""
    return {
        "today": ModelShape(
            name="today's projection workload: 64 pooled tables x 1e5 rows x dim 128, pooling 8",
            batch_per_rank=4096, dense_param_bytes=4 * 20e6,
            features=(Feature(name="t", tables=64, rows=100_000, dim=128, ids_per_example=8, zipf_exponent=zipf),),
            note="compute fitted to the published 1D FP32 1.21x on 4 nodes",
        ),
        "criteo_tb": ModelShape(
            name="Criteo-Terabyte-like: 26 single-hot pooled tables up to 4e7 rows, dim 128",
            batch_per_rank=8192, dense_param_bytes=4 * 16e6, compute_s=0.010,
            features=tuple(Feature(name=f"c{i}", rows=r, dim=128, ids_per_example=1, zipf_exponent=zipf) for i, r in enumerate(CRITEO_TB_ROWS)),
            note="compute 10 ms per 8192 examples assumed (DCN-v2-sized dense layers, ~0.8M examples/s per GPU)",
        ),
        "sequence": ModelShape(
            name="sequence-heavy ranker: 256-id histories over 1e8 items and 1e7 creators, 16 pooled context tables",
            batch_per_rank=512, dense_param_bytes=4 * 50e6, compute_s=0.060,
            features=(
                Feature(name="item_history", rows=100_000_000, dim=128, ids_per_example=256, pooled=False, zipf_exponent=zipf),
                Feature(name="creator_history", rows=10_000_000, dim=64, ids_per_example=256, pooled=False, zipf_exponent=zipf),
                Feature(name="context", tables=16, rows=1_000_000, dim=64, ids_per_example=2, zipf_exponent=zipf),
            ),
            note="compute 60 ms per 512 examples assumed (a transformer over 256-token histories, ~8.5k examples/s per GPU)",
        ),
    }  # fmt: skip


# --------------------------------------------------------------------------- the emulated runs
def emulated_cluster_spec(data: dict[str, Any]) -> Cluster:
    shaping = data["shaping"]
    return Cluster(
        nodes=data["topology"]["nodes"],
        ranks_per_node=data["topology"]["ranks_per_node"],
        intra=Link.free(),  # loopback: its cost is inside the unshaped step time
        inter=Link(
            bandwidth_bytes_per_s=shaping["bandwidth_mbit"] * 1e6 / 8,
            latency_s=shaping["latency_ms"] * 1e-3,
            burst_bytes=shaping["tbf_burst_bytes"],  # the TBF bucket, as configured
        ),
    )


def measured_shape(data: dict[str, Any], entry: dict[str, Any], tables: list[str] | None = None) -> ModelShape:
    """The emulated job as a ModelShape (SGD: no optimizer state); ``tables``: only those (t_sparse_i names)."""
    cfg, result = entry["cluster"]["config"], entry["cluster"]
    sizes = result.get("table_sizes") or [int(cfg["table_rows"])] * cfg["tables"]
    # max: in 2D on gloo across nodes each stage of the dense all-reduce carries the whole bucket (dense_all_reduce).
    dense = max((r["payload_bytes"] for r in result["traffic_per_step_rank0"] if r["purpose"] == "dense_grads"), default=0.0)
    features = tuple(
        Feature(name=f"t_sparse_{i}", rows=rows, dim=cfg["embedding_dim"], ids_per_example=cfg["pooling_factor"],
                zipf_exponent=cfg.get("zipf_exponent", 1.05))
        for i, rows in enumerate(sizes) if tables is None or f"t_sparse_{i}" in tables
    )  # fmt: skip
    world = data["topology"]["nodes"] * data["topology"]["ranks_per_node"]
    return ModelShape(name="emulated", batch_per_rank=cfg["global_batch_size"] // world, features=features,
                      dense_param_bytes=dense, optimizer_state_per_row=0.0)  # fmt: skip


def layout_of(entry: dict[str, Any], world: int) -> StrategyChoice:
    forward, backward = QCOMMS_PRECISIONS[entry["qcomms"]]
    group = entry["sharding_group_size"] if entry["sharding_group_size"] < world else None
    sync = ReplicaSyncConfig(rows=entry.get("sync_rows", "all"), every_n_steps=entry["sync_every_n_steps"],
                    overlap=entry.get("sync_overlap", False), precision=entry.get("sync_precision", "fp32"),
                    exchange=entry.get("sync_exchange", "all_reduce"))  # fmt: skip
    return StrategyChoice(sharding_group_size=group, layout=entry["layout"], forward=forward, backward=backward, sync=sync)


def bytes_check(data: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per purpose: analytic vs measured bytes; per touched-sync config: expected vs measured rank-0 rows per sync."""
    cluster = emulated_cluster_spec(data)
    rows, unions = [], []
    for entry in data["configs"]:
        layout = layout_of(entry, cluster.world_size)
        topology = topology_for(cluster, layout.sharding_group_size, layout.layout)
        analytic: dict[str, float] = {}
        for c in workload_traffic(measured_shape(data, entry), layout, topology, staged_dense=True):  # gloo: staged in 2D
            analytic[c.purpose] = analytic.get(c.purpose, 0.0) + c.payload_bytes
        measured: dict[str, float] = {}
        for r in entry["cluster"]["traffic_per_step_rank0"]:
            measured[r["purpose"]] = measured.get(r["purpose"], 0.0) + r["payload_bytes"]
        for purpose in sorted(set(analytic) | set(measured)):
            a, m = analytic.get(purpose), measured.get(purpose)
            rows.append({"config": entry["name"], "purpose": purpose, "analytic": a, "measured": m,
                         "ratio": a / m if a is not None and m else None})  # fmt: skip
        sync = entry["cluster"].get("replica_sync")
        tables = entry["cluster"].get("rank0_tables")
        if layout.is_2d and layout.sync.rows == "touched" and sync and tables:
            shape = measured_shape(data, entry, tables)
            draws = layout.sync.every_n_steps * entry["cluster"]["config"]["global_batch_size"]
            expected = sum(expected_distinct(f.rows, draws * f.ids_per_example, f.zipf_exponent) for f in shape.features)
            unions.append({"config": entry["name"], "every_n_steps": layout.sync.every_n_steps, "rank0_tables": len(tables),
                           "expected_rows_per_sync": expected, "measured_rows_per_sync": sync["rows_per_sync"],
                           "measured_touched_fraction": sync["touched_fraction"], "ratio": expected / sync["rows_per_sync"],
                           "within_tolerance": abs(expected / sync["rows_per_sync"] - 1) <= TOLERANCE})  # fmt: skip
    return rows, unions


def validate(data: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = emulated_cluster_spec(data)
    out = []
    for entry in data["configs"]:
        layout = layout_of(entry, cluster.world_size)
        topology = topology_for(cluster, layout.sharding_group_size, layout.layout)
        collectives = collectives_from_accounting(entry["cluster"]["traffic_per_step_rank0"])
        unshaped = entry["reference"]["step_time_s"]
        hidden = overlapped_purposes(layout, dense_grads=False)  # CPU DDP runs its all-reduce after backward
        estimate = step_time(collectives, topology, cluster, unshaped, overlapped=hidden)
        predicted = network_penalty(collectives, topology, cluster, unshaped, overlapped=hidden)
        measured = entry["network_penalty"]
        out.append({
            "config": entry["name"], "label": entry["label"], "unshaped_step_s": unshaped,
            "predicted_step_s": estimate.step_s, "measured_step_s": entry["cluster"]["step_time_s"],
            "predicted_penalty": predicted, "measured_penalty": measured,
            "relative_error": predicted / measured - 1.0, "within_tolerance": abs(predicted / measured - 1.0) <= TOLERANCE,
            "predicted_inter_node_bytes_per_node": estimate.inter_node_bytes,
            "modelled_seconds_by_purpose": estimate.seconds_by_purpose(),
        })  # fmt: skip
    return out


# --------------------------------------------------------------------------- projection and regime map
FAMILIES: dict[str, Any] = {
    "1D FP32": lambda lay: not lay.is_2d and lay.forward == "fp32" and not lay.index_dedup,
    "1D FP8 fwd / BF16 bwd": lambda lay: not lay.is_2d and lay.forward == "fp8" and not lay.index_dedup,
    "1D FP32, index dedup": lambda lay: not lay.is_2d and lay.forward == "fp32" and lay.index_dedup,
    "1D FP8 fwd / BF16 bwd, index dedup": lambda lay: not lay.is_2d and lay.forward == "fp8" and lay.index_dedup,
    "best 1D (any precision, dedup or not)": lambda lay: not lay.is_2d,
    "2D whole-shard sync": lambda lay: lay.is_2d and lay.sync.rows == "all",
    "2D touched sync, blocking fp32": lambda lay: _touched(lay, False, "fp32", "all_reduce"),
    "2D touched sync, bf16 deltas": lambda lay: _touched(lay, False, "bf16", "all_reduce"),
    "2D touched sync, overlapped": lambda lay: _touched(lay, True, "fp32", "all_reduce"),
    "2D touched sync, overlapped, bf16 deltas": lambda lay: _touched(lay, True, "bf16", "all_reduce"),
    "2D touched all-gather, bf16 or fp8 deltas": lambda lay: _touched(lay, False, None, "all_gather"),
    "2D touched all-gather, overlapped, bf16 or fp8 deltas": lambda lay: _touched(lay, True, None, "all_gather"),
    "best 2D": lambda lay: lay.is_2d,
}  # fmt: skip
# 2D families take their best variant, with or without index dedup (it shrinks 2D's intra-node all-to-all too).


def _touched(lay: Any, overlap: bool, precision: str | None, exchange: str) -> bool:
    sync = lay.sync
    return bool(lay.is_2d and sync.rows == "touched" and sync.overlap == overlap and sync.exchange == exchange
                and (precision is None or sync.precision == precision))  # fmt: skip


def best_of(projections: list[Projection], family: Any, max_interval: int) -> Projection | None:
    return next((p for p in projections if family(p.layout) and (not p.layout.is_2d or p.layout.sync.every_n_steps <= max_interval)), None)


def project_workload(shape: ModelShape, hardware: Hardware, max_interval: int) -> dict[str, Any]:
    layouts = candidate_layouts()
    by_nodes = {n: project(shape, layouts, hardware, n) for n in NODE_COUNTS}
    families = {}
    for label, family in FAMILIES.items():
        points = []
        for n in NODE_COUNTS:
            best = best_of(by_nodes[n], family, max_interval)
            if best is not None:
                points.append({"nodes": n, "scaling": best.scaling, "step_s": best.step_s, "config": best.layout.describe(),
                               "seconds_by_purpose": best.estimate.seconds_by_purpose(),
                               "inter_node_bytes_per_node": best.estimate.inter_node_bytes})  # fmt: skip
        families[label] = points
    best_any = by_nodes[8][0]
    best_k = next(p for p in by_nodes[8] if not p.layout.is_2d or p.layout.sync.every_n_steps <= max_interval)
    best_1d = best_of(by_nodes[8], FAMILIES["best 1D (any precision, dedup or not)"], max_interval)
    best_2d = best_of(by_nodes[8], FAMILIES["best 2D"], max_interval)
    if best_1d is None or best_2d is None:
        raise RuntimeError("candidate_layouts() must offer both 1D and 2D layouts")
    need = None if best_k.scaling >= TARGET_SCALING else compute_for_scaling(shape, best_k.layout, hardware, 8, TARGET_SCALING, layouts)
    interval_needed = next((p.layout.sync.every_n_steps for p in sorted(by_nodes[8], key=lambda p: p.layout.sync.every_n_steps)
                            if p.layout.is_2d and p.scaling >= TARGET_SCALING), None)  # fmt: skip
    return {
        "workload": shape.name, "compute_s": shape.compute_s, "note": shape.note, "families": families,
        "best_8_nodes": {"config": best_k.layout.describe(), "scaling": best_k.scaling, "max_interval": max_interval,
                         "compute_needed_for_target_s": need, "smallest_2d_interval_reaching_target": interval_needed},
        "best_8_nodes_any_interval": {"config": best_any.layout.describe(), "scaling": best_any.scaling},
        "best_1d_8_nodes": {"config": best_1d.layout.describe(), "scaling": best_1d.scaling, "step_s": best_1d.step_s},
        "best_2d_8_nodes": {"config": best_2d.layout.describe(), "scaling": best_2d.scaling, "step_s": best_2d.step_s,
                            "step_vs_best_1d": best_2d.step_s / best_1d.step_s},
    }  # fmt: skip


def fit_today_compute(shape: ModelShape, hardware: Hardware) -> float:
    """The compute time at which 1D FP32 scales 1.21x on 4 nodes (the published 'before' point)."""
    fitted = compute_for_scaling(shape, StrategyChoice(), hardware, 4, PUBLISHED["before"][4], [StrategyChoice()])
    if fitted is None:
        raise ValueError("no compute time <= 10 s gives 1D FP32 1.21x on 4 nodes for today's workload")
    return fitted


def regime_sweep(hardware: Hardware, compute_s: float, max_interval: int) -> list[dict[str, Any]]:
    """One feature kind at a time: 8 tables of 1e7 rows x dim 128, batch 1024 per GPU; best config at 8 nodes."""
    out = []
    layouts = [lay for lay in candidate_layouts() if not lay.is_2d or lay.sync.every_n_steps <= max_interval]
    for pooled in (True, False):
        for length in (1, 8, 64, 256):
            for zipf in (0.8, 1.05, 1.3):
                shape = ModelShape(
                    name="sweep", batch_per_rank=1024, dense_param_bytes=4 * 20e6, compute_s=compute_s,
                    features=(Feature(name="f", tables=8, rows=10_000_000, dim=128, ids_per_example=length, pooled=pooled, zipf_exponent=zipf),),
                )  # fmt: skip
                ranked = project(shape, layouts, hardware, 8, baseline_layouts=candidate_layouts())
                best_1d = next(p for p in ranked if not p.layout.is_2d)  # deduped 1D included (sequence features)
                best_1d_plain = next(p for p in ranked if not p.layout.is_2d and not p.layout.index_dedup)
                best_2d = next(p for p in ranked if p.layout.is_2d)
                # As layout_advice.recommend: a tie (within 5%) goes to 1D, which needs no replicas.
                best = best_1d if best_1d.step_s <= best_2d.step_s * (1 + TIE) else best_2d
                k = best_2d.layout.sync.every_n_steps
                draws = k * 1024 * 64 * length
                fraction = expected_distinct(10_000_000, draws, zipf) / draws
                batch_ids = 1024 * length  # what one rank's index dedup sees: its own batch, per table
                batch_fraction = expected_distinct(10_000_000, batch_ids, zipf) / batch_ids
                out.append({"pooled": pooled, "ids_per_example": length, "zipf_exponent": zipf,
                            "unique_fraction_of_ids": fraction, "unique_fraction_of_rank_batch": batch_fraction,
                            "best": best.layout.describe(), "best_scaling": best.scaling,
                            "best_1d": best_1d.layout.describe(), "best_1d_scaling": best_1d.scaling,
                            "best_1d_without_dedup_scaling": best_1d_plain.scaling,
                            "best_2d": best_2d.layout.describe(), "best_2d_scaling": best_2d.scaling, "best_2d_interval": k})  # fmt: skip
    return out


def interval_sweep(shape: ModelShape, hardware: Hardware) -> list[dict[str, Any]]:
    out = []
    for k in INTERVALS:
        layouts = [lay for lay in candidate_layouts([k]) if lay.is_2d and lay.sync.rows == "touched"]
        row = {"every_n_steps": k}
        for p in project(shape, layouts, hardware, 8, baseline_layouts=candidate_layouts()):
            row.setdefault(p.layout.sync.describe().replace(f"every {k}", "").replace("touched rows, ", "").strip(", ") or "blocking fp32",
                           p.scaling)  # fmt: skip
        out.append(row)
    return out


def write_plot(results: dict[str, Any], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'lightning-recsys[bench]'); no PNG written."
    fig, axes = plt.subplots(1, len(results["workloads"]), figsize=(6 * len(results["workloads"]), 5.5), squeeze=False)
    for ax, (key, w) in zip(axes[0], results["workloads"].items()):
        ax.plot(NODE_COUNTS, NODE_COUNTS, color="0.7", ls=":", label="linear")
        for label, points in w["families"].items():
            ax.plot([p["nodes"] for p in points], [p["scaling"] for p in points], marker="o", label=label)
        if key == "today":
            ax.scatter(list(PUBLISHED["before"]), list(PUBLISHED["before"].values()), marker="X", s=120, color="k", zorder=5,
                       label="published before (fit point)")  # fmt: skip
        ax.scatter(list(PUBLISHED["after"]), list(PUBLISHED["after"].values()), marker="*", s=180, color="k", zorder=5, label="published after")
        ax.set_title(f"{w['workload']}\ncompute {w['compute_s'] * 1e3:.1f} ms/step", fontsize=8)
        ax.set_xlabel("nodes of 8 GPUs")
        ax.set_ylabel("throughput / best one-node throughput")
        ax.set_xticks(NODE_COUNTS)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="upper left")
    fig.suptitle(f"PROJECTION (cost model, not a measurement); 2D sync interval <= {results['max_interval']}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# --------------------------------------------------------------------------- main
def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.3f}"


def print_measured(data: dict[str, Any]) -> dict[str, Any]:
    checks, unions = bytes_check(data)
    print("## 1. Bytes per step and rank: analytic formula vs measured accounting (MB)\n")
    print("| configuration | purpose | analytic | measured | analytic/measured |\n|---|---|---|---|---|")
    for r in checks:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        print(f"| {r['config']} | {r['purpose']} | {_mb(r['analytic'])} | {_mb(r['measured'])} | {ratio} |")
    if unions:
        print("\nRows per touched-row sync on rank 0: Zipf union estimate vs measured (strategy.replica_sync_stats)\n")
        print("| configuration | interval | rank-0 tables | expected rows | measured rows (touched fraction) | expected/measured |\n|---|---|---|---|---|---|")
        for u in unions:
            print(f"| {u['config']} | {u['every_n_steps']} | {u['rank0_tables']} | {u['expected_rows_per_sync']:,.0f} | "
                  f"{u['measured_rows_per_sync']:,.0f} ({u['measured_touched_fraction']:.2%}) | {u['ratio']:.3f} |")  # fmt: skip
        ok = all(u["within_tolerance"] for u in unions)
        print(f"\nUnion estimate within {TOLERANCE:.0%} for every touched-sync configuration: {'YES' if ok else 'NO'}")
    shaping = data["shaping"]
    print(f"\n## 2. Network penalty, predicted vs measured (emulated cluster: {shaping['bandwidth_mbit']:g} Mbit/s, "
          f"{shaping['latency_ms']:g} ms one-way; fitted: compute = measured unshaped step)\n")  # fmt: skip
    print("| configuration | unshaped ms | measured ms | predicted ms | measured penalty | predicted penalty | error |\n|---|---|---|---|---|---|---|")
    validation = validate(data)
    for v in validation:
        print(f"| {v['label']} | {v['unshaped_step_s'] * 1e3:.0f} | {v['measured_step_s'] * 1e3:.0f} | {v['predicted_step_s'] * 1e3:.0f} | "
              f"{v['measured_penalty']:.2f} | {v['predicted_penalty']:.2f} | {v['relative_error']:+.0%} |")  # fmt: skip
    ok = all(v["within_tolerance"] for v in validation)
    worst = max(validation, key=lambda v: abs(v["relative_error"]))
    print(f"\nWithin {TOLERANCE:.0%} for every configuration: {'YES' if ok else 'NO'} (largest error {worst['relative_error']:+.0%}, {worst['config']})")
    return {"bytes_check": checks, "union_check": unions, "validation": validation, "validated": ok}


def main(argv: list[str] | None = None) -> int:
    hw_default = Hardware()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measured", type=Path, default=RESULTS / "emulated_cluster.json", help="emulated_cluster.py's JSON")
    parser.add_argument("--no-measured", action="store_true", help="skip parts 1-2 (no emulated-cluster JSON needed)")
    for name, default in asdict(hw_default).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default, help=f"projection (default {default})")
    parser.add_argument("--zipf-exponent", type=float, default=1.05, help="Zipf exponent of every projected table's ids")
    parser.add_argument("--sweep-compute-ms", type=float, default=20.0, help="compute per step of the regime map's workloads")
    parser.add_argument("--max-interval", type=int, default=4, help="largest 2D sync interval the headline projections may use")
    parser.add_argument("--pretrain-compute-ms-per-1k-tokens", type=float, default=0.5,
                        help="the pretraining regime map's compute per 1000 input tokens of a GPU's batch")  # fmt: skip
    parser.add_argument("--skip-pretrain", action="store_true", help="leave out parts 5-6 (pretraining)")
    parser.add_argument("--sequence-file", type=Path, default=Path("data/beauty.txt"),
                        help="part 5 also checks this sequence file's batches where it exists (Amazon Beauty: docs/pretraining.md)")  # fmt: skip
    parser.add_argument("--json", type=Path, default=RESULTS / "cost_model.json")
    parser.add_argument("--png", type=Path, default=RESULTS / "cost_model_projection.png")
    parser.add_argument("--no-png", action="store_true")
    args = parser.parse_args(argv)
    hardware = Hardware(**{k: getattr(args, k) for k in asdict(hw_default)})
    out: dict[str, Any] = {"hardware": asdict(hardware), "max_interval": args.max_interval}
    if not args.no_measured:
        if not args.measured.exists():
            print(f"cost_model: {args.measured} does not exist; run `python benchmarks/emulated_cluster.py` first (as root), "
                  "or pass --no-measured.", file=sys.stderr)  # fmt: skip
            return 2
        out["measured"] = str(args.measured)
        out.update(print_measured(json.loads(args.measured.read_text())))

    shapes = workloads(args.zipf_exponent)
    shapes["today"] = replace(shapes["today"], compute_s=fit_today_compute(shapes["today"], hardware))
    h = hardware
    print(f"\n## 3. Projection (model, not measured): {h.gpus_per_node} GPUs/node, NVLink-class {h.intra_gbyte_s:g} GB/s per GPU, "
          f"EFA-class {h.inter_gbit_s:g} Gb/s per node; ids Zipf({args.zipf_exponent:g}); row-wise Adagrad state synced with the "
          f"rows; DDP and overlapped syncs hidden behind compute up to the compute time; 2D sync interval <= {args.max_interval}\n")  # fmt: skip
    out["workloads"] = {}
    for key, shape in shapes.items():
        result = project_workload(shape, hardware, args.max_interval)
        out["workloads"][key] = result
        print(f"### {shape.name}\n\ncompute {shape.compute_s * 1e3:.1f} ms/step ({shape.note}); batch {shape.batch_per_rank} per GPU\n")
        print("| family (best variant) | " + " | ".join(f"{n} node{'s' if n > 1 else ''}" for n in NODE_COUNTS) + " | config at 8 nodes |")
        print("|---" * (len(NODE_COUNTS) + 2) + "|")
        for label, points in result["families"].items():
            cells = " | ".join(f"{p['scaling']:.2f}x" for p in points)
            print(f"| {label} | {cells} | {points[-1]['config']} |")
        b = result["best_8_nodes"]
        verdict = "meets" if b["scaling"] >= TARGET_SCALING else "short of"
        print(f"\nBest at 8 nodes (interval <= {args.max_interval}): {b['config']}: **{b['scaling']:.2f}x** ({verdict} {TARGET_SCALING}x).")
        one, two = result["best_1d_8_nodes"], result["best_2d_8_nodes"]
        print(f"Best 1D at 8 nodes: {one['config']}: {one['scaling']:.2f}x; best 2D (interval <= {args.max_interval}): "
              f"{two['config']}: {two['scaling']:.2f}x, its step {two['step_vs_best_1d']:.2f}x the best 1D's "
              f"({1 / two['step_vs_best_1d'] - 1:+.0%} throughput).")  # fmt: skip
        if b["scaling"] < TARGET_SCALING:
            need = b["compute_needed_for_target_s"]
            print(f"{TARGET_SCALING}x would need " + (f"{need * 1e3:.0f} ms of compute per step" if need else "> 10 s of compute per step")
                  + (f", or a 2D sync every {b['smallest_2d_interval_reaching_target']} steps" if b["smallest_2d_interval_reaching_target"] else "")
                  + ".")  # fmt: skip
        print()

    compute = args.sweep_compute_ms / 1e3
    sweep = regime_sweep(hardware, compute, args.max_interval)
    out["regime_sweep"] = sweep
    print(f"## 4. Regime map (8 nodes x 8 GPUs): one feature kind, 8 tables x 1e7 rows x dim 128, batch 1024/GPU, compute "
          f"{compute * 1e3:.0f} ms, 2D interval <= {args.max_interval}. Cell: best config, its scaling (best 1D, deduped where "
          "that helps [best 1D without dedup] / best 2D); u = unique fraction of the 2D sync interval's ids, d = of one "
          "rank's batch (what index dedup keeps)\n")  # fmt: skip
    zipfs = sorted({r["zipf_exponent"] for r in sweep})
    print("| feature | ids/example | " + " | ".join(f"Zipf {z:g}" for z in zipfs) + " |\n|---|---|" + "---|" * len(zipfs))
    for pooled in (True, False):
        for length in sorted({r["ids_per_example"] for r in sweep}):
            cells = []
            for z in zipfs:
                r = next(r for r in sweep if r["pooled"] == pooled and r["ids_per_example"] == length and r["zipf_exponent"] == z)
                kind = "2D" if r["best"].startswith("2D") else "1D"
                plain = "" if r["pooled"] else f" [{r['best_1d_without_dedup_scaling']:.2f}]"
                cells.append(f"{kind} {r['best_scaling']:.2f}x ({r['best_1d_scaling']:.2f}{plain} / {r['best_2d_scaling']:.2f}, "
                             f"u={r['unique_fraction_of_ids']:.2f}, d={r['unique_fraction_of_rank_batch']:.2f})")
            print(f"| {'pooled' if pooled else 'sequence'} | {length} | " + " | ".join(cells) + " |")
    intervals = interval_sweep(shapes["sequence"], hardware)
    out["interval_sweep_sequence"] = intervals
    print("\nSequence-heavy workload, 2D touched-row sync at 8 nodes by interval:\n")
    keys = [k for k in intervals[0] if k != "every_n_steps"]
    print("| interval | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for row in intervals:
        print(f"| {row['every_n_steps']} | " + " | ".join(f"{row[k]:.2f}x" for k in keys) + " |")

    if not args.skip_pretrain:
        import _pretrain_cost

        out["pretrain_check"] = _pretrain_cost.pretrain_check(args.sequence_file)
        out["pretrain_regime"] = _pretrain_cost.pretrain_regime(hardware, args.pretrain_compute_ms_per_1k_tokens)

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2, default=str))
    print(f"\nwrote {args.json}")
    if not args.no_png:
        problem = write_plot(out, args.png)
        print(problem or f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
