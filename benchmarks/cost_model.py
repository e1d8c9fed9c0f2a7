"""Communication cost model: validated on the emulated cluster, then projected to 8-GPU nodes.

    python benchmarks/cost_model.py                       # reads benchmarks/results/emulated_cluster.json
    python benchmarks/cost_model.py --measured other.json --compute-ms 15 --projection-sync-every 100

Input: the JSON of ``emulated_cluster.py`` (per configuration: rank 0's bytes per step of every
collective from ``strategy.comm_accounting``, the unshaped and shaped step times, the tc settings).
The model is ``lightning_recsys.parallel.cost_model``. Three parts:

1. **Bytes.** The analytic traffic formulas (batch, tables, dim, rows, precision, group size)
   against the accounting's measured bytes, per purpose. Nothing is fitted.
2. **Validation.** Predicted network penalty = (unshaped step + modelled network time) / unshaped
   step, against the measured penalty. Fitted: only the compute time, which is the measured
   unshaped step time of the same configuration (loopback traffic is inside it). Given: the
   measured bytes per collective, and tc's rate, delay and TBF bucket from the JSON. Target:
   within 25%.
3. **Projection.** Each configuration's measured traffic is rescaled analytically to a production-
   like workload (stated below) on 1, 2, 4 and 8 nodes of 8 GPUs, NVLink-class inside a node and a
   400 Gb/s EFA-class uplink per node. The compute time per step is either given (``--compute-ms``)
   or fitted to one published figure, 1D FP32's 1.21x on 4 nodes (the "before" figure of the
   production account: Pinterest Engineering, June 2026, 2D parallelism with FP8 QComms on up to 8 nodes
   of 8 GPUs); all other points are predictions, and the plot says it is a
   projection.

Prints Markdown tables, writes JSON (default ``benchmarks/results/cost_model.json``) and, with
matplotlib, ``benchmarks/results/cost_model_projection.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lightning_recsys.parallel.cost_model import (
    Cluster,
    Collective,
    Link,
    Parallelism,
    Workload,
    analytic_traffic,
    collectives_from_accounting,
    fit_compute_for_scaling,
    network_penalty,
    scale_traffic,
    scaling_factor,
    step_time,
    topology_for,
)

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TOLERANCE = 0.25
NODE_COUNTS = (1, 2, 4, 8)
# The published production account (Pinterest Engineering, June 2026): scaling against one node.
PUBLISHED = {"before": {4: 1.21}, "after": {4: 3.9, 8: 7.5}}
QCOMMS_PRECISIONS = {"fp32": ("fp32", "fp32"), "bf16": ("bf16", "bf16"), "fp16": ("fp16", "fp16"),
                     "fp8": ("fp8", "fp8"), "int8": ("int8", "bf16"), "fp8_fwd_bf16_bwd": ("fp8", "bf16")}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class ProjectionSetup:
    gpus_per_node: int = 8
    nvlink_gbyte_s: float = 300.0  # per GPU per direction (A100 NVLink 3: 600 GB/s both ways)
    nvlink_latency_us: float = 5.0
    efa_gbit_s: float = 400.0  # per node (p4d-class: 4 x 100 Gb/s EFA)
    efa_latency_us: float = 20.0
    batch_per_gpu: int = 4096
    tables: int = 64
    embedding_dim: int = 128
    rows_per_table: int = 100_000
    pooling_factor: float = 8.0
    dense_params: int = 20_000_000
    overlap_dense_grads: bool = True  # DDP overlaps its all-reduce with backward on GPUs

    def cluster(self, nodes: int) -> Cluster:
        return Cluster(
            nodes=nodes,
            ranks_per_node=self.gpus_per_node,
            intra=Link(bandwidth_bytes_per_s=self.nvlink_gbyte_s * 1e9, latency_s=self.nvlink_latency_us * 1e-6),
            inter=Link.gbit(self.efa_gbit_s, self.efa_latency_us),
        )

    def workload(self) -> Workload:
        return Workload(
            batch_per_rank=self.batch_per_gpu, num_tables=self.tables, embedding_dim=self.embedding_dim,
            rows_per_table=self.rows_per_table, pooling_factor=self.pooling_factor, dense_param_bytes=4.0 * self.dense_params,
        )  # fmt: skip


def measured_workload(data: dict[str, Any], entry: dict[str, Any]) -> Workload:
    cfg = entry["cluster"]["config"]
    dense = sum(r["payload_bytes"] for r in entry["cluster"]["traffic_per_step_rank0"] if r["purpose"] == "dense_grads")
    world = data["topology"]["nodes"] * data["topology"]["ranks_per_node"]
    return Workload(
        batch_per_rank=cfg["global_batch_size"] // world, num_tables=cfg["tables"], embedding_dim=cfg["embedding_dim"],
        rows_per_table=cfg["table_rows"], pooling_factor=cfg["pooling_factor"], dense_param_bytes=dense,
    )  # fmt: skip


def parallelism_of(entry: dict[str, Any], sharding_group_size: int | None, sync_every: int | None = None) -> Parallelism:
    forward, backward = QCOMMS_PRECISIONS[entry["qcomms"]]
    return Parallelism(
        sharding_group_size=sharding_group_size, layout=entry["layout"], forward=forward, backward=backward,
        sync_every_n_steps=sync_every or entry["sync_every_n_steps"],
    )  # fmt: skip


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


# --------------------------------------------------------------------------- 1 and 2: bytes and validation
def bytes_check(data: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = emulated_cluster_spec(data)
    rows = []
    for entry in data["configs"]:
        world = cluster.world_size
        group = entry["sharding_group_size"] if entry["sharding_group_size"] < world else None
        topology = topology_for(cluster, group, entry["layout"])
        analytic = {
            c.purpose: c.payload_bytes for c in analytic_traffic(measured_workload(data, entry), parallelism_of(entry, group), topology)
        }
        measured: dict[str, float] = {}
        for r in entry["cluster"]["traffic_per_step_rank0"]:
            measured[r["purpose"]] = measured.get(r["purpose"], 0.0) + r["payload_bytes"]
        for purpose in sorted(set(analytic) | set(measured)):
            a, m = analytic.get(purpose), measured.get(purpose)
            rows.append({"config": entry["name"], "purpose": purpose, "analytic": a, "measured": m,
                         "ratio": a / m if a is not None and m else None})  # fmt: skip
    return rows


def validate(data: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = emulated_cluster_spec(data)
    out = []
    for entry in data["configs"]:
        group = entry["sharding_group_size"] if entry["sharding_group_size"] < cluster.world_size else None
        topology = topology_for(cluster, group, entry["layout"])
        collectives = collectives_from_accounting(entry["cluster"]["traffic_per_step_rank0"])
        unshaped = entry["reference"]["step_time_s"]
        estimate = step_time(collectives, topology, cluster, unshaped)
        predicted = network_penalty(collectives, topology, cluster, unshaped)
        measured = entry["network_penalty"]
        out.append({
            "config": entry["name"], "label": entry["label"], "unshaped_step_s": unshaped,
            "predicted_step_s": estimate.step_s, "measured_step_s": entry["cluster"]["step_time_s"],
            "predicted_penalty": predicted, "measured_penalty": measured,
            "relative_error": predicted / measured - 1.0, "within_tolerance": abs(predicted / measured - 1.0) <= TOLERANCE,
            "predicted_inter_node_bytes_per_node": estimate.inter_node_bytes,
            "tbf_bytes_per_node_per_step": _tbf_bytes_per_step(data, entry),
            "modelled_seconds_by_purpose": estimate.seconds_by_purpose(),
        })  # fmt: skip
    return out


def _tbf_bytes_per_step(data: dict[str, Any], entry: dict[str, Any]) -> float | None:
    """What the TBFs really passed per node per step (start-up and warm-up traffic included, so an upper bound)."""
    tbf = entry["cluster"].get("tbf") or {}
    if not tbf:
        return None
    steps = data["steps"]["warmup"] + data["steps"]["timed"] + 1
    return sum(v["bytes"] for v in tbf.values()) / len(tbf) / steps


# --------------------------------------------------------------------------- 3: projection
def project(data: dict[str, Any], setup: ProjectionSetup, compute_ms: float | None, extra_sync_every: int | None) -> dict[str, Any]:
    source_cluster = emulated_cluster_spec(data)
    target = setup.workload()
    variants: list[tuple[dict[str, Any], int | None, str]] = [(e, None, e["label"]) for e in data["configs"]]
    base = next((e for e in data["configs"] if e["name"] == "2d_a2a_fp8_bf16"), None)
    if extra_sync_every and base is not None:
        variants.append((base, extra_sync_every, f"{base['label']}, sync every {extra_sync_every} (projection only)"))

    def traffic(entry: dict[str, Any], sync_every: int | None, nodes: int) -> tuple[list[Collective], Any, Cluster]:
        group_src = entry["sharding_group_size"] if entry["sharding_group_size"] < source_cluster.world_size else None
        cluster = setup.cluster(nodes)
        group = None if group_src is None else setup.gpus_per_node  # 2D: one sharding group per node
        if group is not None and group >= cluster.world_size:
            group = None
        topology = topology_for(cluster, group, entry["layout"])
        scaled = scale_traffic(
            collectives_from_accounting(entry["cluster"]["traffic_per_step_rank0"]),
            measured_workload=measured_workload(data, entry),
            measured_parallelism=parallelism_of(entry, group_src),
            measured_topology=topology_for(source_cluster, group_src, entry["layout"]),
            workload=target,
            parallelism=parallelism_of(entry, group, sync_every),
            topology=topology,
        )
        return scaled, topology, cluster

    overlapped = ("dense_grads",) if setup.overlap_dense_grads else ()
    baseline = next(e for e in data["configs"] if e["name"] == "1d_fp32")
    fitted = compute_ms is None
    if fitted:
        comm = {}
        for n in (1, 4):
            collectives, topology, cluster = traffic(baseline, None, n)
            # Dense grads are hidden under compute when overlapped; fit with them exposed, then check.
            comm[n] = step_time([c for c in collectives if c.purpose not in overlapped], topology, cluster, 0.0).step_s
        compute_s = fit_compute_for_scaling(comm[1], comm[4], 4, PUBLISHED["before"][4])
    else:
        compute_s = compute_ms / 1e3

    curves = []
    for entry, sync_every, label in variants:
        points = []
        one_node = None
        for n in NODE_COUNTS:
            collectives, topology, cluster = traffic(entry, sync_every, n)
            estimate = step_time(collectives, topology, cluster, compute_s, overlapped=overlapped)
            one_node = one_node or estimate.step_s
            points.append({
                "nodes": n, "gpus": cluster.world_size, "step_s": estimate.step_s,
                "scaling": scaling_factor(one_node, estimate.step_s, n),
                "examples_per_s": cluster.world_size * setup.batch_per_gpu / estimate.step_s,
                "inter_node_bytes_per_node": estimate.inter_node_bytes,
                "seconds_by_purpose": estimate.seconds_by_purpose(),
            })  # fmt: skip
        curves.append(
            {"config": entry["name"], "label": label, "sync_every_n_steps": sync_every or entry["sync_every_n_steps"], "points": points}
        )
    return {"setup": asdict(setup), "compute_s": compute_s, "compute_fitted_to": "1D FP32 1.21x on 4 nodes" if fitted else None,
            "overlapped": list(overlapped), "curves": curves, "published": PUBLISHED}  # fmt: skip


def write_plot(projection: dict[str, Any], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'lightning-recsys[bench]'); no PNG written."
    fig, ax = plt.subplots(figsize=(9, 6))
    ax.plot(NODE_COUNTS, NODE_COUNTS, color="0.7", ls=":", label="linear")
    for curve in projection["curves"]:
        xs = [p["nodes"] for p in curve["points"]]
        ys = [p["scaling"] for p in curve["points"]]
        ls = "--" if "projection only" in curve["label"] else "-"
        ax.plot(xs, ys, marker="o", ls=ls, label=f"model: {curve['label']}")
    before, after = projection["published"]["before"], projection["published"]["after"]
    ax.scatter(list(before), list(before.values()), marker="X", s=140, color="k", zorder=5, label="published, before (1.21x @ 4 nodes)")
    ax.scatter(list(after), list(after.values()), marker="*", s=220, color="k", zorder=5, label="published, after (3.9x @ 4, 7.5x @ 8)")
    s = projection["setup"]
    fitted = f"compute {projection['compute_s'] * 1e3:.1f} ms/step" + (
        " (fitted to the 1.21x point)" if projection["compute_fitted_to"] else " (given)"
    )
    ax.set_title(
        "PROJECTION (cost model, not a measurement): throughput scaling vs 1 node\n"
        f"{s['gpus_per_node']} GPUs/node, NVLink {s['nvlink_gbyte_s']:g} GB/s/GPU, EFA {s['efa_gbit_s']:g} Gb/s/node; "
        f"{s['tables']} tables x {s['rows_per_table']:,} rows x dim {s['embedding_dim']}, batch {s['batch_per_gpu']}/GPU\n{fitted}",
        fontsize=9,
    )
    ax.set_xlabel("nodes")
    ax.set_ylabel("throughput / throughput on 1 node")
    ax.set_xticks(NODE_COUNTS)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# --------------------------------------------------------------------------- main
def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.3f}"


def main(argv: list[str] | None = None) -> int:
    d = ProjectionSetup()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measured", type=Path, default=RESULTS / "emulated_cluster.json", help="emulated_cluster.py's JSON")
    parser.add_argument(
        "--compute-ms", type=float, default=None, help="projection compute time per step (default: fitted to 1.21x @ 4 nodes)"
    )
    parser.add_argument(
        "--projection-sync-every", type=int, default=64, help="an extra 2D all-to-all FP8 curve with this sync interval (0: none)"
    )
    for name, default in asdict(d).items():
        if isinstance(default, bool):
            parser.add_argument(f"--{name.replace('_', '-')}", action=argparse.BooleanOptionalAction, default=default)
        else:
            parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default, help=f"projection (default {default})")
    parser.add_argument("--json", type=Path, default=RESULTS / "cost_model.json")
    parser.add_argument("--png", type=Path, default=RESULTS / "cost_model_projection.png")
    parser.add_argument("--no-png", action="store_true")
    args = parser.parse_args(argv)
    if not args.measured.exists():
        print(f"cost_model: {args.measured} does not exist; run `python benchmarks/emulated_cluster.py` first (as root).", file=sys.stderr)
        return 2
    data = json.loads(args.measured.read_text())
    setup = ProjectionSetup(**{k: getattr(args, k) for k in asdict(d)})

    print("## 1. Bytes per step and rank: analytic formula vs measured accounting (MB)\n")
    print("| configuration | purpose | analytic | measured | analytic/measured |\n|---|---|---|---|---|")
    checks = bytes_check(data)
    for r in checks:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.4f}"
        print(f"| {r['config']} | {r['purpose']} | {_mb(r['analytic'])} | {_mb(r['measured'])} | {ratio} |")

    shaping = data["shaping"]
    print(
        f"\n## 2. Network penalty, predicted vs measured (emulated cluster: {shaping['bandwidth_mbit']:g} Mbit/s, "
        f"{shaping['latency_ms']:g} ms one-way; fitted: compute = measured unshaped step)\n"
    )
    print(
        "| configuration | unshaped ms | measured ms | predicted ms | measured penalty | predicted penalty | error | inter-node MB/node/step: model / TBF counter |"
    )
    print("|---|---|---|---|---|---|---|---|")
    validation = validate(data)
    for v in validation:
        tbf = "-" if v["tbf_bytes_per_node_per_step"] is None else f"{v['tbf_bytes_per_node_per_step'] / 1e6:.2f}"
        print(
            f"| {v['label']} | {v['unshaped_step_s'] * 1e3:.0f} | {v['measured_step_s'] * 1e3:.0f} | {v['predicted_step_s'] * 1e3:.0f} | "
            f"{v['measured_penalty']:.2f} | {v['predicted_penalty']:.2f} | {v['relative_error']:+.0%} | "
            f"{v['predicted_inter_node_bytes_per_node'] / 1e6:.2f} / {tbf} |"
        )
    ok = all(v["within_tolerance"] for v in validation)
    worst = max(validation, key=lambda v: abs(v["relative_error"]))
    print(
        f"\nWithin {TOLERANCE:.0%} for every configuration: {'YES' if ok else 'NO'} (largest error {worst['relative_error']:+.0%}, {worst['config']})"
    )

    projection = project(data, setup, args.compute_ms, args.projection_sync_every or None)
    s = setup
    print(
        f"\n## 3. Projection (model, not measured): {s.gpus_per_node} GPUs/node, NVLink-class {s.nvlink_gbyte_s:g} GB/s per GPU "
        f"({s.nvlink_latency_us:g} us), EFA-class {s.efa_gbit_s:g} Gb/s per node ({s.efa_latency_us:g} us); workload per GPU: "
        f"batch {s.batch_per_gpu}, {s.tables} tables x {s.rows_per_table:,} rows x dim {s.embedding_dim}, pooling {s.pooling_factor:g}, "
        f"{s.dense_params / 1e6:g}M dense params{' (all-reduce overlapped with backward)' if s.overlap_dense_grads else ''}; "
        f"compute {projection['compute_s'] * 1e3:.1f} ms/step"
        + (" (fitted to 1D FP32 = 1.21x on 4 nodes)" if projection["compute_fitted_to"] else " (given)")
        + "\n"
    )
    header = "| configuration | " + " | ".join(f"{n} node{'s' if n > 1 else ''}" for n in NODE_COUNTS) + " |"
    print(header + "\n" + "|---" * (len(NODE_COUNTS) + 1) + "|")
    for curve in projection["curves"]:
        cells = " | ".join(f"{p['scaling']:.2f}x ({p['step_s'] * 1e3:.1f} ms)" for p in curve["points"])
        print(f"| {curve['label']} | {cells} |")
    print("| published (production account) | - | - | before 1.21x, after 3.9x | after 7.5x |")

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"measured": str(args.measured), "bytes_check": checks, "validation": validation,
                                     "tolerance": TOLERANCE, "validated": ok, "projection": projection}, indent=2))  # fmt: skip
    print(f"\nwrote {args.json}")
    if not args.no_png:
        problem = write_plot(projection, args.png)
        print(problem or f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
