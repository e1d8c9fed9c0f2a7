"""Time-to-quality on the emulated cluster: how soon each configuration's pretraining reaches one validation NDCG@10.

    sudo python benchmarks/time_to_quality.py                        # calibrate on 1D FP32, then 3 configurations x 3 repeats
    sudo python benchmarks/time_to_quality.py --threshold 0.45 --repeats 1
    sudo python benchmarks/time_to_quality.py --set data.num_items=2048 --set model.embedding_dim=64

Throughput alone does not say which layout trains a model sooner: lower precision on the wire or replicas
synced every few steps may need more steps. This runs the synthetic pretraining config
(``examples/configs/synthetic_pretrain.yaml``: ``SequencePretrainer`` on planted item chains, so a quality
threshold is reachable in minutes on a CPU; ``--set`` changes its model or data) on the emulated 2 nodes x 2
ranks of ``emulated_cluster.py`` (a network namespace per node, the link between them shaped by ``tc``; root
needed) under three configurations: 1D FP32, 1D with index dedup and FP8 QComms, and the 2D configuration the
cost model ranks best for this workload on this link.

1. **The threshold** (unless ``--threshold``): one 1D FP32 run of ``--calibration-steps`` steps; the threshold is
   ``--threshold-fraction`` of the best validation NDCG@10 it reached.
2. **The runs**: every configuration ``--repeats`` times (alternating order), each validated every
   ``--eval-every`` steps and stopped at the first validation at or above the threshold. Reported: the steps,
   the training seconds (from the first step, validations left out) and the wall seconds to get there.
   The target: the fastest configuration gets there at least 1.2x sooner than 1D FP32 (training seconds),
   judged in each repeat against that repeat's 1D FP32 run.
3. **The cost model**: its predicted step time per configuration (bytes from batches of this data) is printed
   before the runs; after them, whether its ranking of the configurations matches the measured ranking.

Writes JSON (default ``benchmarks/results/time_to_quality.json``). The runs' logs go beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _pretrain_workload import training_batches
from _quality_job import load_config
from emulated.configs import CONFIGS, NODES, RANKS_PER_NODE, WORKLOADS, BenchConfig, unavailable_reason
from emulated.network import SetupError, add_link_arguments, build_cluster, preflight, remove_stale_namespaces, sandbox_guard
from emulated.runs import run_job, strategy_arguments

HERE = Path(__file__).resolve().parent
JOB = HERE / "_quality_job.py"
TARGET = 1.2  # 1D FP32's training seconds to the threshold / the fastest configuration's
# The shipped synthetic config reaches its plateau in about 30 steps; 64x its items (8x per chain) take about 100
# steps to 90% of theirs, and the item ids' bytes then weigh in the step. --set goes on top of these.
WORKLOAD_SETS = ("data.num_items=32768", "data.num_clusters=8", "data.num_users=16384", "data.global_batch_size=256",
                 "data.num_negatives=256", "model.embedding_dim=64")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_link_arguments(parser)
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override the synthetic pretraining config: model.NAME or data.NAME, or any dotted key it has "
        f"(e.g. trainer.strategy.init_args.embedding_optimizer.lr=0.1); after this benchmark's own: {' '.join(WORKLOAD_SETS)}",
    )
    parser.add_argument("--configs", default=None, help="comma-separated (default: 1d_fp32, 1d_dedup_fp8 and the best 2D by the cost model)")
    parser.add_argument("--threshold", type=float, default=None, help="val/ndcg@10 to reach (default: calibrated on a 1D FP32 run)")
    parser.add_argument("--threshold-fraction", type=float, default=0.9, help="the threshold as this fraction of the calibration's best")
    parser.add_argument("--calibration-steps", type=int, default=256, help="steps of the 1D FP32 calibration run")
    parser.add_argument("--max-steps", type=int, default=512, help="a run that has not reached the threshold by then stops")
    parser.add_argument("--eval-every", type=int, default=16, help="validate every this many steps (a multiple of every sync interval)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--replica-average", default="auto", choices=["auto", "all_replicas", "touching_replicas"],
        help="ReplicaSyncConfig.average of the 2D runs (auto: over the replicas that touched a row, with row-wise Adagrad)",
    )
    parser.add_argument("--predict-compute-ms", type=float, default=100.0, help="the compute per step the cost model assumes")
    parser.add_argument("--run-timeout", type=float, default=900.0, help="seconds for one launch pair, start-up included")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "time_to_quality.json")
    args = parser.parse_args(argv)
    if not 0.0 < args.threshold_fraction <= 1.0 or args.repeats < 1 or args.eval_every < 1:
        parser.error(f"--threshold-fraction={args.threshold_fraction} must be in (0, 1], --repeats={args.repeats} and "
                     f"--eval-every={args.eval_every} >= 1")  # fmt: skip
    args.set = [*WORKLOAD_SETS, *args.set]
    try:
        args.config = load_config(JOB.parent.parent / "examples" / "configs" / "synthetic_pretrain.yaml", args.set)
    except ValueError as exc:
        parser.error(str(exc))
    args.steps = args.max_steps  # run_job's name for a run's length
    return args


def workload_shape(args: argparse.Namespace) -> Any:
    """The cost model's ``ModelShape`` of this config, learned from every rank's first 4 training batches."""
    from _quality_job import instantiate_linked

    from lightning_recsys.planner.cost import PretrainWorkload

    data, model = instantiate_linked(args.config)
    per_rank = training_batches(args, NODES * RANKS_PER_NODE, 4, data)  # the emulated pretrain workload's sampler, on this data
    batches = [b for rank_batches in per_rank.values() for b in rank_batches]
    init = args.config["model"]["init_args"]
    workload = PretrainWorkload.from_batches(batches, items=data.num_items, dim=init["embedding_dim"])
    dense = float(sum(4 * p.numel() for n, p in model.named_parameters() if "_embeddings." not in n))
    return workload.model_shape(dense_param_bytes=dense, name="synthetic pretraining")


def choose_configs(args: argparse.Namespace, shape: Any, link: Any) -> list[BenchConfig]:
    from emulated.prediction import best_2d

    if args.configs is not None:
        names = [n.strip() for n in args.configs.split(",") if n.strip()]
    else:
        candidates = [c for c in CONFIGS if c.name in WORKLOADS["pretrain"].two_d_candidates and unavailable_reason(c) is None]
        names = ["1d_fp32", "1d_dedup_fp8", best_2d(shape, candidates, link, args.predict_compute_ms / 1e3).name]
    unknown = sorted(set(names) - {c.name for c in CONFIGS})
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; choose from {[c.name for c in CONFIGS]}")
    chosen = [c for c in CONFIGS if c.name in names]
    for c in chosen:
        if args.eval_every % c.sync_every_n_steps:
            raise SystemExit(f"--eval-every={args.eval_every} must be a multiple of {c.name}'s sync interval {c.sync_every_n_steps}")
    return chosen


def _replica_average_line(args: argparse.Namespace, configs: list[BenchConfig]) -> str:
    """Which replicas the 2D runs average a row over (``ReplicaSyncConfig.average`` resolved for the tables' optimizer)."""
    from lightning_recsys import EmbeddingOptimizerConfig, ReplicaSyncConfig

    optimizer = EmbeddingOptimizerConfig(**args.config["trainer"]["strategy"]["init_args"]["embedding_optimizer"])
    lines = []
    for c in configs:
        if c.is_2d:
            sync = ReplicaSyncConfig(rows=c.sync_rows, average=args.replica_average)  # type: ignore[arg-type]
            over = "the replicas that touched it" if sync.averages_over_touching_replicas(optimizer.is_adaptive) else "all replicas"
            lines.append(f"{c.name}: each row over {over}")
    where = "; ".join(lines) or "no 2D configuration"
    return f"Embedding optimizer {optimizer.name}, lr {optimizer.lr:g}; replica average {args.replica_average!r} ({where})."


def one_run(env: Any, cfg: BenchConfig, args: argparse.Namespace, *, threshold: float | None, steps: int, port: int,
            log_dir: Path) -> dict[str, Any]:  # fmt: skip
    out = log_dir / f"{cfg.name}.{port}.json"
    job_args = [
        "--out", str(out), "--devices", str(RANKS_PER_NODE), "--num-nodes", str(NODES), "--max-steps", str(steps),
        "--eval-every", str(args.eval_every), *(["--threshold", str(threshold)] if threshold is not None else []),
        *[f"--set={item}" for item in args.set], *strategy_arguments(cfg), "--sync-average", args.replica_average,
    ]  # fmt: skip
    return run_job(env, cfg, args, port=port, out_json=out, log_dir=log_dir, job=JOB, job_args=job_args)


def print_curve(points: list[dict[str, float]]) -> None:
    print("| step | training s | NDCG@10 |\n|---|---|---|")
    for p in points:
        print(f"| {p['step']} | {p['train_s']:.1f} | {p['ndcg10']:.4f} |")


def summarize(runs: dict[str, list[dict[str, Any]]], configs: list[BenchConfig], threshold: float) -> dict[str, Any]:
    """Per configuration: steps and seconds to the threshold in each repeat; per repeat, each against that repeat's 1D FP32."""
    print(f"\nTime to val/ndcg@10 >= {threshold:.4f} (each repeat; '-' = not reached within --max-steps):\n")
    print("| configuration | steps | training s | wall s (with validation) | median training s | 1D FP32 / this (median) | "
          "inter-node MB per training step, rank 0 |")
    print("|---|---|---|---|---|---|---|")
    base = "1d_fp32"

    def train_s(r: dict[str, Any]) -> float | None:
        return r["reached"]["train_s"] if r.get("reached") else None

    medians: dict[str, float | None] = {}
    for c in configs:
        times = [train_s(r) for r in runs.get(c.name, [])]
        medians[c.name] = statistics.median(times) if times and all(t is not None for t in times) else None
    rows = {}
    for c in configs:
        rs = runs.get(c.name, [])
        steps = " / ".join(str(r["reached"]["step"]) if r.get("reached") else "-" for r in rs)
        trains = " / ".join(f"{r['reached']['train_s']:.1f}" if r.get("reached") else "-" for r in rs)
        walls = " / ".join(f"{r['reached']['wall_s']:.1f}" if r.get("reached") else "-" for r in rs)
        m, b = medians[c.name], medians.get(base)
        speedup = b / m if m and b else None
        rows[c.name] = {"steps": [r["reached"]["step"] if r.get("reached") else None for r in rs],
                        "train_s": [train_s(r) for r in rs], "median_train_s": m, "speedup_vs_1d_fp32": speedup}  # fmt: skip
        inter = next((r["bytes_per_step_rank0"]["inter_node"] for r in rs if "bytes_per_step_rank0" in r), None)
        print(f"| {c.label} | {steps} | {trains} | {walls} | {'-' if m is None else f'{m:.1f}'} | "
              f"{'-' if speedup is None else f'{speedup:.2f}x'} | {'-' if inter is None else f'{inter / 1e6:.2f}'} |")  # fmt: skip
    repeats = min((len(runs.get(c.name, [])) for c in configs), default=0)
    judged: dict[str, Any] = {}
    for clock, text in (("train_s", "training seconds"), ("wall_s", "wall seconds with the validations")):
        held, per_repeat = 0, []
        for i in range(repeats):
            times = {c.name: runs[c.name][i]["reached"][clock] for c in configs if runs[c.name][i].get("reached")}
            if base not in times:
                per_repeat.append(None)
                continue
            fastest = min(times, key=times.__getitem__)
            ratio = times[base] / times[fastest]
            held += ratio >= TARGET
            per_repeat.append({"fastest": fastest, "speedup": ratio})
        line = "; ".join(f"{r['fastest']} {r['speedup']:.2f}x" if r else "1D FP32 did not reach it" for r in per_repeat)
        print(f"- by {text}, the fastest against 1D FP32 per repeat: {line}; at least {TARGET}x sooner: held in {held} of {repeats} repeats")
        judged[clock] = {"per_repeat": per_repeat, "target_held": held}
    return {"configs": rows, "per_repeat": judged["train_s"]["per_repeat"], "target_held": judged["train_s"]["target_held"],
            "by_wall_s": judged["wall_s"], "repeats": repeats}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        preflight(args.latency_ms, args.delay_method)
    except SetupError as exc:
        print(f"time_to_quality: cannot run here: {exc}", file=sys.stderr)
        return 2
    from emulated.prediction import emulated_link_cluster, predict

    log_dir = args.json.parent / "time_to_quality_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    link = emulated_link_cluster(args.bandwidth_mbit, args.latency_ms, args.mtu)
    shape = workload_shape(args)
    configs = choose_configs(args, shape, link)
    base = next((c for c in CONFIGS if c.name == "1d_fp32"), None)
    if base not in configs:
        print("time_to_quality: --configs must include 1d_fp32 (the baseline every speedup is against)", file=sys.stderr)
        return 2
    started, load_before = time.monotonic(), os.getloadavg()
    model, data = args.config["model"]["init_args"], args.config["data"]["init_args"]
    print(f"Emulated cluster: {NODES} nodes x {RANKS_PER_NODE} ranks, {args.bandwidth_mbit:g} Mbit/s and {args.latency_ms:g} ms "
          f"one-way between nodes. Model: SequencePretrainer, {model['encoder']['init_args']['num_layers']} block(s), dim {model['embedding_dim']}, "
          f"{data['num_items']} items in {data['num_clusters']} planted chains, {data['num_users']} users, global batch "
          f"{data['global_batch_size']}, {data['num_negatives']} negatives per rank; validated every {args.eval_every} steps.")  # fmt: skip
    print(_replica_average_line(args, configs))
    print("\nCost model, before the runs (compute assumed "
          f"{args.predict_compute_ms:g} ms per step; the same steps assumed for every configuration):\n")  # fmt: skip
    print("| configuration | predicted step ms | predicted inter-node MB per step and node |\n|---|---|---|")
    predicted = {}
    for c in configs:
        e = predict(shape, c, link, args.predict_compute_ms / 1e3)
        predicted[c.name] = e.step_s
        print(f"| {c.label} | {e.step_s * 1e3:.0f} | {e.inter_node_bytes / 1e6:.3f} |")
    payload: dict[str, Any] = {"link": {"bandwidth_mbit": args.bandwidth_mbit, "latency_ms": args.latency_ms}, "model": model,
                               "data": data, "eval_every": args.eval_every, "predicted_step_s": predicted,
                               "replica_average": args.replica_average}  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {}
    with sandbox_guard() as sandbox:
        stale = remove_stale_namespaces()
        if stale:
            print(f"removed namespaces left by earlier killed runs: {stale}")
        try:
            cluster, _ = build_cluster(sandbox, bandwidth_mbit=args.bandwidth_mbit, latency_ms=args.latency_ms, mtu=args.mtu,
                                       delay_method=args.delay_method)  # fmt: skip
        except SetupError as exc:
            print(f"time_to_quality: cannot build the emulated network: {exc}", file=sys.stderr)
            return 2
        port = 29710
        threshold = args.threshold
        if threshold is None:
            print(f"\nCalibration: 1D FP32 for {args.calibration_steps} steps, validated every {args.eval_every}:\n", flush=True)
            calibration = one_run(cluster, base, args, threshold=None, steps=args.calibration_steps, port=port, log_dir=log_dir)
            print_curve(calibration["points"])
            best = max(p["ndcg10"] for p in calibration["points"])
            threshold = round(args.threshold_fraction * best, 4)
            print(f"\nThreshold: {args.threshold_fraction:g} x the best val/ndcg@10 of the calibration ({best:.4f}) = {threshold:.4f}", flush=True)
            payload["calibration"] = calibration
        payload["threshold"] = threshold
        for repeat in range(args.repeats):
            order = configs if repeat % 2 == 0 else configs[::-1]  # a shared machine's drift hits every configuration alike
            for c in order:
                port += 1
                try:
                    result = one_run(cluster, c, args, threshold=threshold, steps=args.max_steps, port=port, log_dir=log_dir)
                except RuntimeError as exc:  # counted as not reached; the others still run
                    print(f"FAILED {exc}", file=sys.stderr, flush=True)
                    result = {"reached": None, "error": str(exc), "steps_run": 0, "wall_s": 0.0}
                runs.setdefault(c.name, []).append(result)
                payload["runs"] = runs
                _write(args.json, payload)  # after every run: a long benchmark keeps what it measured
                where = (f"step {result['reached']['step']}, {result['reached']['train_s']:.1f} s" if result.get("reached")
                         else f"not reached in {result['steps_run']} steps")  # fmt: skip
                print(f"  repeat {repeat + 1} {c.name:28s} {where} (run {result['wall_s']:.0f} s)", flush=True)
    payload["runs"] = runs
    payload["summary"] = summary = summarize(runs, configs, threshold)
    measured = [n for n, row in sorted(summary["configs"].items(), key=lambda kv: kv[1]["median_train_s"] or float("inf"))]
    by_model = sorted(predicted, key=predicted.__getitem__)
    payload["cost_model_ranking_matched"] = matched = measured == by_model
    print(f"- cost model's ranking (by predicted step): {' < '.join(by_model)}; measured (by median training s to the threshold): "
          f"{' < '.join(measured)}: {'matched' if matched else 'did not match'}")  # fmt: skip
    payload["elapsed_s"], payload["load_before"], payload["load_after"] = time.monotonic() - started, load_before, os.getloadavg()
    print(f"\n{payload['elapsed_s'] / 60:.1f} min; load average before {load_before[0]:.1f}, after {payload['load_after'][0]:.1f}")
    _write(args.json, payload)
    print(f"wrote {args.json}")
    return 0


def _write(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    sys.exit(main())
