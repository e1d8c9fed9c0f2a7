"""The emulated cluster's report: each configuration against one common baseline, the target, JSON and PNG."""

from __future__ import annotations

import argparse
import os
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from emulated.configs import MOONSHOT, NODES, RANKS_PER_NODE, TARGET, WORKLOADS, BenchConfig
from emulated.network import Shaping


@dataclass
class Row:
    cfg: BenchConfig
    cluster: dict[str, Any] = field(default_factory=dict)
    reference: dict[str, Any] = field(default_factory=dict)

    @property
    def penalty(self) -> float:
        return self.cluster["step_time_s"] / self.reference["step_time_s"]


def inter_by_purpose(result: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in result["traffic_per_step_rank0"]:
        if r["inter_node_bytes"]:
            out[r["purpose"]] = out.get(r["purpose"], 0.0) + r["inter_node_bytes"]
    return out


def common_baseline(rows: list[Row]) -> tuple[str, float]:
    """The one baseline every configuration is measured against: the fastest unshaped step of any of them."""
    best = min(rows, key=lambda r: r.reference["step_time_s"])
    return best.cfg.name, best.reference["step_time_s"]


def sync_cells(result: dict[str, Any]) -> tuple[str, str]:
    sync = result.get("replica_sync")
    if not sync:
        return "-", "-"
    return f"{sync['rows_per_sync']:,.0f} ({sync['touched_fraction']:.2%})", f"{sync['payload_bytes_per_sync'] / 1e6:.2f}"


def markdown_table(rows: list[Row]) -> str:
    base_name, base = common_baseline(rows)
    head = (
        f"| configuration | group x replicas | step ms cluster | step ms unshaped | **cluster step / best unshaped ({base * 1e3:.0f} ms)** | "
        "own unshaped | rank-0 rows per sync (touched) | MB per sync | inter-node MB/step | inter-node MB by purpose |"
    )
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for row in rows:
        c, r, cfg = row.cluster, row.reference, row.cfg
        purposes = ", ".join(f"{k} {v / 1e6:.2f}" for k, v in sorted(inter_by_purpose(c).items()))
        rows_cell, mb_cell = sync_cells(c)
        lines.append(
            f"| {cfg.label} | {cfg.sharding_group_size} x {NODES * RANKS_PER_NODE // cfg.sharding_group_size} | "
            f"{c['step_time_s'] * 1e3:.0f} | {r['step_time_s'] * 1e3:.0f} | **{c['step_time_s'] / base:.2f}** | "
            f"{row.penalty:.2f} | {rows_cell} | {mb_cell} | {c['bytes_per_step_rank0']['inter_node'] / 1e6:.2f} | {purposes or '-'} |"
        )
    return "\n".join(lines)


def target_verdict(rows: list[Row]) -> dict[str, Any] | None:
    """The target: the best 2D configuration's cluster step <= 1.25x the best unshaped step (moonshot 1.10x)."""
    two_d = [r for r in rows if r.cfg.is_2d]
    if not two_d:
        return None
    base_name, base = common_baseline(rows)
    best = min(two_d, key=lambda r: r.cluster["step_time_s"])
    one_d = [r for r in rows if not r.cfg.is_2d]
    best_1d = min(one_d, key=lambda r: r.cluster["step_time_s"]) if one_d else None
    ratio = best.cluster["step_time_s"] / base
    return {
        "baseline_config": base_name, "baseline_step_s": base, "best_2d_config": best.cfg.name,
        "best_2d_cluster_step_s": best.cluster["step_time_s"], "ratio": ratio, "target": TARGET, "moonshot": MOONSHOT,
        "met": ratio <= TARGET, "moonshot_met": ratio <= MOONSHOT,
        "best_1d_config": best_1d.cfg.name if best_1d else None,
        "best_1d_ratio": best_1d.cluster["step_time_s"] / base if best_1d else None,
    }  # fmt: skip


def write_png(rows: list[Row], shaping: Shaping, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'lightning-recsys[bench]'); no PNG written."
    base_name, base = common_baseline(rows)
    ratios = [r.cluster["step_time_s"] / base for r in rows]
    labels = [textwrap.fill(r.cfg.label, 14) for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(16, 5.5))
    ax1.bar(range(len(rows)), ratios, color=["#b44" if not r.cfg.is_2d else "#48b" for r in rows])
    ax1.axhline(1.0, color="k", lw=1, ls="--", label=f"best unshaped step ({base_name}, {base * 1e3:.0f} ms)")
    ax1.axhline(TARGET, color="g", lw=1, ls=":", label=f"target {TARGET}x")
    for i, ratio in enumerate(ratios):
        ax1.text(i, ratio, f"{ratio:.2f}", ha="center", va="bottom", fontsize=9)
    ax1.set_xticks(range(len(rows)), labels, fontsize=7)
    ax1.set_ylabel("cluster step / best unshaped step")
    ax1.set_title("Step time on the emulated cluster, one common baseline (lower is better)")
    ax1.legend(fontsize=8)
    intra = [r.cluster["bytes_per_step_rank0"]["intra_node"] / 1e6 for r in rows]
    inter = [r.cluster["bytes_per_step_rank0"]["inter_node"] / 1e6 for r in rows]
    x = list(range(len(rows)))
    ax2.bar([i - 0.2 for i in x], intra, 0.4, label="intra-node")
    ax2.bar([i + 0.2 for i in x], inter, 0.4, label="inter-node")
    ax2.set_xticks(x, labels, fontsize=7)
    ax2.set_ylabel("MB per step (rank 0, comm accounting)")
    ax2.set_title("Bytes per step")
    ax2.legend()
    fig.suptitle(
        f"Emulated 2 nodes x 2 ranks on one machine: {shaping.bandwidth_mbit:g} Mbit/s, "
        f"{shaping.latency_ms:g} ms one-way between nodes ({shaping.delay_method} delay)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def print_results(rows: list[Row], args: argparse.Namespace, *, elapsed: float, load_before: tuple[float, float, float]) -> dict[str, Any] | None:
    """The table, the target's verdict, the delay line's CPU and the TBF drops; returns the verdict."""
    print()
    print(markdown_table(rows))
    verdict = target_verdict(rows)
    if verdict is not None:
        print(
            f"\nTarget: best 2D configuration ({verdict['best_2d_config']}) cluster step = {verdict['ratio']:.2f}x the best "
            f"unshaped step ({verdict['baseline_config']}, {verdict['baseline_step_s'] * 1e3:.0f} ms); needs <= {TARGET}x: "
            f"{'MET' if verdict['met'] else 'MISSED'} (moonshot <= {MOONSHOT}x: {'MET' if verdict['moonshot_met'] else 'MISSED'})."
            + (f" Best 1D: {verdict['best_1d_config']}, {verdict['best_1d_ratio']:.2f}x." if verdict["best_1d_config"] else "")
        )
    drops = sum(d["dropped"] for r in rows for d in r.cluster.get("tbf", {}).values())
    if any("delay_line_cpu_s" in r.cluster for r in rows):
        per_step = {
            r.cfg.name: 1e3 * r.cluster["delay_line_cpu_s"] / (args.warmup_steps + args.steps + 1)
            for r in rows
            if "delay_line_cpu_s" in r.cluster
        }
        print("\nDelay line CPU per step (ms, start-up traffic included): " + ", ".join(f"{k} {v:.1f}" for k, v in per_step.items()))
    timed_cpu = {r.cfg.name: r.cluster["delay_line_timed_cpu_s"] for r in rows if "delay_line_timed_cpu_s" in r.cluster}
    if timed_cpu:
        print(
            "Delay line CPU per timed step (ms, user + system): "
            + ", ".join(f"{k} {1e3 * c['user'] / c['steps']:.1f} + {1e3 * c['system'] / c['steps']:.1f}" for k, c in timed_cpu.items())
        )
    print(
        f"\nTBF drops over all cluster runs: {drops}.  Total time {elapsed:.0f} s; load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}."
    )
    return verdict


def results_payload(
    rows: list[Row],
    args: argparse.Namespace,
    *,
    shaping: Shaping,
    elapsed: float,
    load_before: tuple[float, float, float],
    verdict: dict[str, Any] | None,
    errors: list[str],
) -> dict[str, Any]:
    """The JSON the benchmark writes (``benchmarks/cost_model.py`` reads it)."""
    return {
        "shaping": asdict(shaping),
        "topology": {"nodes": NODES, "ranks_per_node": RANKS_PER_NODE},
        "model": WORKLOADS[args.workload].model_json(args),
        "steps": {"warmup": args.warmup_steps, "timed": args.steps, "repeats": args.repeats},
        "machine": {"cpus": os.cpu_count(), "load_avg_before": load_before, "load_avg_after": os.getloadavg()},
        "elapsed_s": elapsed,
        "common_baseline": dict(zip(("config", "step_time_s"), common_baseline(rows))),
        "configs": [
            {**asdict(r.cfg), "vs_best_unshaped": r.cluster["step_time_s"] / common_baseline(rows)[1],
             "network_penalty": r.penalty, "sync_measured": r.cluster.get("replica_sync"),
             "cluster": r.cluster, "reference": r.reference} for r in rows
        ],
        "target": verdict,
        "skipped": args.skipped,
        "errors": errors,
    }  # fmt: skip
