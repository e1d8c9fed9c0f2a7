"""Overhead of Trainer + TwoDRecStrategy against hand-written TorchRec training loops.

Same model, same data (pre-generated batches, so data generation does not count), same plan,
2 processes, 1D, gloo on CPU. Variants, run interleaved several times, at each global batch:

* ``raw``: ``DistributedModelParallel`` and a plain loop (forward, BCE, backward, dense step);
* ``raw_pipeline``: the same model and optimizer driven by TorchRec's ``TrainPipelineSparseDist``
  (the next batch's input distribution overlaps this batch's step);
* ``lightning``: ``Trainer(strategy=TwoDRecStrategy())`` with its defaults (``pipeline="sparse_dist"``,
  ``GuardConfig(validate_inputs="error")``: the per-step input check and the batch handshake between ranks);
* ``lightning_off``: the same with ``pipeline="off"``.

``--workload pretrain``: the same comparison for ``SequencePretrainer`` at the shipped Beauty batch
(``examples/configs/beauty_pretrain.yaml``), in tokens per second (input positions with a next-item
target), plus ``plain`` and ``plain_adam``: the same model and loss in plain PyTorch (``nn.Embedding``,
torch optimizers, no TorchRec) in ONE process with 2 threads. ``--profile-steps N`` then profiles N
steps of ``lightning`` and of ``plain`` and prints milliseconds per step by phase. Details:
``_pretrain_speed_workload.py``.

    python benchmarks/overhead.py                      # batches 1024 and 8192; Markdown; JSON in benchmarks/results/
    python benchmarks/overhead.py --global-batch 1024 --steps 150
    python benchmarks/overhead.py --workload pretrain --pretrain-path beauty.txt --profile-steps 10
    python benchmarks/overhead.py --workload pretrain       # without the file: Beauty-like synthetic sequences
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

import torch

import _pretrain_speed_workload as pretrain
from lightning_recsys.testing.processes import run_ranks

WORLD_SIZE = 2
TABLES, ROWS, DIM = 8, 20_000, 32
GLOBAL_BATCH = 1024
WARMUP = 30
RESULTS = Path(__file__).resolve().parent / "results"


def _batches(rank: int, steps: int) -> list[Any]:
    from lightning_recsys.data import SyntheticClickLog, SyntheticClickLogConfig, slice_batch

    global_batch = int(os.environ.get("OVERHEAD_GLOBAL_BATCH", GLOBAL_BATCH))
    log = SyntheticClickLog(SyntheticClickLogConfig(table_sizes=[ROWS] * TABLES, global_batch_size=global_batch, seed=3))
    local = global_batch // WORLD_SIZE
    unique = [slice_batch(log.global_batch("train", i), rank * local, (rank + 1) * local) for i in range(16)]
    return [unique[i % len(unique)] for i in range(steps)]


def _model() -> torch.nn.Module:
    from lightning_recsys.models import DLRMRanker

    torch.manual_seed(0)
    return DLRMRanker(
        table_sizes=[ROWS] * TABLES, embedding_dim=DIM, dense_arch_layer_sizes=[64, DIM],
        over_arch_layer_sizes=[64, 32, 1], embedding_device="meta", dense_optimizer="sgd", dense_lr=0.01,
    )


def _raw(rank: int, steps: int, pipelined: bool) -> list[float]:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    from lightning_recsys.parallel import EmbeddingOptimizerConfig, make_sharders
    from lightning_recsys.planner import make_sharding_plan

    dist.init_process_group("gloo")
    model = _model()
    sharders = make_sharders(EmbeddingOptimizerConfig(name="sgd", lr=0.01).fused_params(), ["table_wise"])
    plan = make_sharding_plan(model, sharders, sharding_group_size=WORLD_SIZE, group_ranks_per_node=WORLD_SIZE, compute_device="cpu")
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"), plan=plan, sharders=sharders)
    dense = [p for n, p in dmp.named_parameters() if "embedding_bags" not in n]
    optimizer = torch.optim.SGD(dense, lr=0.01)
    stamps = []
    if pipelined:
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
        from torchrec.streamable import Pipelineable

        class Batch(Pipelineable):  # TrainPipelineSparseDist moves and records batches through this interface
            def __init__(self, dense: torch.Tensor, sparse: Any, labels: torch.Tensor) -> None:
                self.dense, self.sparse, self.labels = dense, sparse, labels

            def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
                return Batch(self.dense.to(device, non_blocking=non_blocking), self.sparse.to(device, non_blocking=non_blocking),
                             self.labels.to(device, non_blocking=non_blocking))

            def record_stream(self, stream: Any) -> None:
                self.dense.record_stream(stream), self.sparse.record_stream(stream), self.labels.record_stream(stream)

        def forward(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
            logits = dmp(batch)
            return F.binary_cross_entropy_with_logits(logits, batch.labels), logits

        pipeline = TrainPipelineSparseDist(dmp, optimizer, torch.device("cpu"), custom_model_fwd=forward)
        iterator = iter([Batch(b.dense, b.sparse, b.labels) for b in _batches(rank, steps)])
        while True:
            try:
                pipeline.progress(iterator)
            except StopIteration:
                break
            stamps.append(time.perf_counter())
    else:
        for batch in _batches(rank, steps):
            optimizer.zero_grad()
            F.binary_cross_entropy_with_logits(dmp(batch), batch.labels).backward()
            optimizer.step()
            stamps.append(time.perf_counter())
    dist.destroy_process_group()
    return stamps


def _lightning(rank: int, steps: int, pipeline: str) -> list[float]:
    from lightning.pytorch import Callback, LightningDataModule, Trainer
    from torch.utils.data import DataLoader

    from lightning_recsys import EmbeddingOptimizerConfig, PlanningConfig, TwoDRecStrategy

    class Stamps(Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def on_train_batch_end(self, *args: Any) -> None:
            self.stamps.append(time.perf_counter())

    class Prepared(LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(_batches(rank, steps), batch_size=None)  # type: ignore[arg-type]

    stamps = Stamps()
    strategy = TwoDRecStrategy(
        embedding_optimizer=EmbeddingOptimizerConfig(name="sgd", lr=0.01),
        planning=PlanningConfig(sharding_types=["table_wise"]),
        pipeline=pipeline,
    )
    trainer = Trainer(
        accelerator="cpu", devices=WORLD_SIZE, strategy=strategy, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[stamps],
        use_distributed_sampler=False,  # each rank's batches are its own already, as in the raw loops (no epoch boundary)
    )
    trainer.fit(_model(), datamodule=Prepared())
    return stamps.stamps


def _pretrain_entry(variant: str, rank: int, steps: int, workload: pretrain.PretrainWorkload, profile_window: Any) -> Any:
    """Stamps of one pretraining variant on this rank; with ``profile_window`` (rank 0 profiles), its breakdown instead."""
    import torch.distributed as dist

    window = profile_window if rank == 0 else None
    if variant.startswith("plain"):
        stamps = pretrain.plain_loop(workload, steps, "adam" if variant == "plain_adam" else "adagrad", profile=window)
    elif variant.startswith("raw"):
        dist.init_process_group("gloo")
        stamps = pretrain.raw_loop(workload, rank, WORLD_SIZE, steps, pipelined=variant == "raw_pipeline", profile=window)
        dist.destroy_process_group()
    else:
        stamps = pretrain.lightning_fit(workload, rank, WORLD_SIZE, steps, "off" if variant == "lightning_off" else "sparse_dist",
                                        profile=window)
    if profile_window is not None:
        return window.result if window is not None else None
    return stamps


def _rank(rank: int, world_size: int, variant: str, steps: int, workload: Any = None, profile_window: Any = None) -> Any:
    torch.set_num_threads(1)  # 2 processes on 2 cores: one thread each (plain PyTorch: one process, 2 threads)
    if workload is not None:
        return _pretrain_entry(variant, rank, steps, workload, profile_window)
    if variant.startswith("raw"):
        return _raw(rank, steps, pipelined=variant == "raw_pipeline")
    return _lightning(rank, steps, "off" if variant == "lightning_off" else "sparse_dist")


VARIANTS = ("raw", "raw_pipeline", "lightning", "lightning_off")


def _spawn(variant: str, steps: int, timeout: float, workload: Any = None, profile_window: Any = None) -> dict[int, Any]:
    """Each rank's result (stamps, or a profile breakdown) of one run of ``variant``. The ranks start as forks of a
    server that has imported torch, TorchRec and Lightning once (spawn where CUDA is available); nothing before the
    first step is timed."""
    world_size = 1 if variant.startswith("plain") else WORLD_SIZE
    return dict(enumerate(run_ranks(_rank, world_size, variant, steps, workload, profile_window, timeout=timeout)))


def run_variant(variant: str, steps: int, timeout: float = 300) -> float:
    """Steps per second after warm-up, on rank 0."""
    rank0 = _spawn(variant, steps, timeout)[0]
    return (len(rank0) - WARMUP) / (rank0[-1] - rank0[WARMUP - 1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=["dlrm", "pretrain"], default="dlrm")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: dlrm 300, pretrain 60)")
    parser.add_argument("--global-batch", type=int, nargs="+", default=None,
                        help=f"global batches to measure (default: dlrm {GLOBAL_BATCH} and 8192, pretrain 128)")
    pretrain_args = parser.add_argument_group("pretrain workload (--workload pretrain)")
    pretrain_args.add_argument("--pretrain-path", default=None, help="a BERT4Rec 'user item' file (Amazon Beauty); default: Beauty-like synthetic")
    pretrain_args.add_argument("--warmup", type=int, default=10, help="first steps of each run not timed (dlrm: always 30)")
    pretrain_args.add_argument("--variants", nargs="+", choices=pretrain.PRETRAIN_VARIANTS, default=list(pretrain.PRETRAIN_VARIANTS))
    pretrain_args.add_argument("--profile-steps", type=int, default=0, help="profile this many steps of lightning and plain (0: none)")
    pretrain_args.add_argument("--num-negatives", type=int, default=16_384)
    pretrain_args.add_argument("--num-items", type=int, default=pretrain.BEAUTY_ITEMS)
    pretrain_args.add_argument("--num-users", type=int, default=pretrain.BEAUTY_USERS, help="synthetic data only")
    pretrain_args.add_argument("--omp-wait-policy", choices=["passive", "active", "default"], default="passive",
                               help="OMP_WAIT_POLICY of every run (only the 2-thread plain process has OpenMP regions)")
    pretrain_args.add_argument("--lookup-kernel-check", action="store_true",
                               help="only time FBGEMM's CPU sequence lookup (PoolingMode.NONE) against SUM with one id per bag")
    pretrain_args.add_argument("--json", default=None, help="write every batch's results here (default: results/overhead_pretrain_batch<B>.json)")
    args = parser.parse_args(argv)
    if args.workload == "pretrain":
        return pretrain_main(args)
    args.steps = args.steps or 300
    args.global_batch = args.global_batch or [GLOBAL_BATCH, 8192]
    summaries = {batch: measure(batch, args.steps, args.repeats) for batch in args.global_batch}
    print(f"\nOverhead against raw TorchRec loops ({WORLD_SIZE} processes, {TABLES} tables x {ROWS} rows x dim {DIM}, "
          f"table_wise, gloo on CPU; {args.repeats} interleaved runs of {args.steps} steps, first {WARMUP} excluded)\n")
    print("| global batch | variant | median steps/s | spread (min-max) | / raw | / raw_pipeline |")
    print("|---|---|---|---|---|---|")
    for batch, summary in summaries.items():
        for v, row in summary["variants"].items():
            print(f"| {batch} | {v} | {row['median_steps_per_s']:.1f} | {row['min']:.1f}-{row['max']:.1f} | "
                  f"{row['ratio_to_raw']:.3f} | {row['ratio_to_raw_pipeline']:.3f} |")
    return {str(b): s for b, s in summaries.items()}


def measure(global_batch: int, steps: int, repeats: int) -> dict[str, Any]:
    """Every variant ``repeats`` times, interleaved; writes ``results/overhead_batch{global_batch}.json``."""
    os.environ["OVERHEAD_GLOBAL_BATCH"] = str(global_batch)  # read by the spawned ranks
    runs: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for repeat in range(repeats):
        for variant in VARIANTS:  # interleaved, so drift on a shared machine hits every variant alike
            runs[variant].append(run_variant(variant, steps))
            print(f"batch {global_batch} repeat {repeat + 1}/{repeats} {variant}: {runs[variant][-1]:.1f} steps/s", file=sys.stderr)
    raw, raw_pipeline = statistics.median(runs["raw"]), statistics.median(runs["raw_pipeline"])
    summary = {
        "setup": {"world_size": WORLD_SIZE, "tables": TABLES, "rows": ROWS, "dim": DIM, "global_batch": global_batch,
                  "steps": steps, "warmup": WARMUP, "repeats": repeats, "sharding": "table_wise", "backend": "gloo (CPU)"},
        "variants": {
            v: {"median_steps_per_s": statistics.median(r), "min": min(r), "max": max(r), "runs": r,
                "ratio_to_raw": statistics.median(r) / raw, "ratio_to_raw_pipeline": statistics.median(r) / raw_pipeline}
            for v, r in runs.items()
        },
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"overhead_batch{global_batch}.json").write_text(json.dumps(summary, indent=2))
    return summary


def pretrain_main(args: argparse.Namespace) -> dict[str, Any]:
    """``--workload pretrain``: tokens per second of each variant, interleaved; optionally the profiled breakdown."""
    if args.lookup_kernel_check:
        rows, ids = args.num_items // WORLD_SIZE, args.num_negatives + 720  # one rank's shard and ids at the shipped batch
        times = pretrain.sequence_lookup_times(rows, ids)
        print(f"FBGEMM CPU lookup, fwd + bwd with fused row-wise Adagrad, {ids} ids into {rows} x 64: "
              + ", ".join(f"{k} {v:.1f} ms" for k, v in times.items()))
        return {"lookup_kernel_check": times}
    steps = args.steps or 60
    if args.omp_wait_policy != "default":
        # libgomp's spinning wait ("active") makes 2 threads slower than 1 on a loaded 2-core machine; the spawned runs inherit it.
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    if steps <= args.warmup or args.warmup < 1:
        raise ValueError(f"--steps={steps} must exceed --warmup={args.warmup} (>= 1): the first --warmup steps are not timed.")
    summaries = {}
    for batch in args.global_batch or [128]:
        workload = pretrain.PretrainWorkload(path=args.pretrain_path, global_batch=batch, num_negatives=args.num_negatives,
                                             num_items=args.num_items, num_users=args.num_users)
        summaries[str(batch)] = summary = measure_pretrain(workload, steps, args.warmup, args.repeats, args.variants)
        if args.profile_steps > 0:
            summary["profile"] = profile_pretrain(workload, args.warmup, args.profile_steps)
        if args.json is None:
            RESULTS.mkdir(parents=True, exist_ok=True)
            (RESULTS / f"overhead_pretrain_batch{batch}.json").write_text(json.dumps(summary, indent=2))
    if args.json is not None:
        Path(args.json).write_text(json.dumps(summaries, indent=2))
    for batch, summary in summaries.items():
        setup = summary["setup"]
        print(f"\nPretraining step against raw TorchRec and plain PyTorch: {setup['workload']}.\n"
              f"TorchRec variants: {WORLD_SIZE} processes x 1 thread, the item table row-wise, gloo on CPU; plain: 1 process x "
              f"{pretrain.PLAIN_THREADS} threads. {args.repeats} interleaved runs of {steps} steps, first {args.warmup} not timed.\n"
              f"Tokens = input positions with a next-item target (non-padding positions); {setup['mean_tokens_per_step']:.0f} "
              f"per global batch of {batch} users on average. Tokens per CPU-second: over the CPU time of every process "
              f"of the run (all threads), steadier than wall time on a shared machine.\n")
        base = "raw" if "raw" in summary["variants"] else next(iter(summary["variants"]))
        print(f"| variant | median tokens/s | min-max | / {base} | / plain | median tokens per CPU-s | / {base} | / plain |")
        print("|---|---|---|---|---|---|---|---|")
        for v, row in summary["variants"].items():
            over_plain = f"{row['ratio_to_plain']:.3f}" if row.get("ratio_to_plain") is not None else "-"
            cpu_over_plain = f"{row['cpu_ratio_to_plain']:.3f}" if row.get("cpu_ratio_to_plain") is not None else "-"
            print(f"| {v} | {row['median_tokens_per_s']:.0f} | {row['min']:.0f}-{row['max']:.0f} | {row['ratio_to_baseline']:.3f} | "
                  f"{over_plain} | {row['median_tokens_per_cpu_s']:.0f} | {row['cpu_ratio_to_baseline']:.3f} | {cpu_over_plain} |")
        if "profile" in summary:
            print_profile(summary["profile"])
    return summaries


def measure_pretrain(workload: pretrain.PretrainWorkload, steps: int, warmup: int, repeats: int, variants: list[str]) -> dict[str, Any]:
    """Every variant ``repeats`` times, interleaved: tokens per second after ``warmup`` steps."""
    tokens = {world: pretrain.step_tokens(workload, world, steps) for world in (1, WORLD_SIZE)}
    if tokens[1] != tokens[WORLD_SIZE]:
        raise AssertionError("the 1-process and the 2-process batches hold different tokens; they must be the same users")
    runs: dict[str, list[float]] = {v: [] for v in variants}
    cpu_runs: dict[str, list[float]] = {v: [] for v in variants}
    for repeat in range(repeats):
        for variant in variants:  # interleaved, so drift on a shared machine hits every variant alike
            stamps = _spawn(variant, steps, timeout=180 + 10 * steps, workload=workload)
            runs[variant].append(pretrain.tokens_per_second(stamps[0], tokens[1], warmup))
            cpu_runs[variant].append(pretrain.tokens_per_cpu_second([stamps[r] for r in sorted(stamps)], tokens[1], warmup))
            print(f"pretrain batch {workload.global_batch} repeat {repeat + 1}/{repeats} {variant}: {runs[variant][-1]:.0f} tokens/s, "
                  f"{cpu_runs[variant][-1]:.0f} tokens per CPU-second", file=sys.stderr)
    base = "raw" if "raw" in runs else variants[0]
    plain = statistics.median(runs["plain"]) if "plain" in runs else None
    return {
        "setup": {"workload": workload.describe(), **{k: v for k, v in vars(workload).items()}, "world_size": WORLD_SIZE,
                  "plain_threads": pretrain.PLAIN_THREADS, "steps": steps, "warmup": warmup, "repeats": repeats,
                  "sharding": "row_wise", "backend": "gloo (CPU)", "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"), "mean_tokens_per_step": pretrain.mean_tokens(tokens[1]),
                  "baseline": base},
        "variants": {
            v: {"median_tokens_per_s": statistics.median(r), "min": min(r), "max": max(r), "runs": r,
                "ratio_to_baseline": statistics.median(r) / statistics.median(runs[base]),
                "ratio_to_plain": statistics.median(r) / plain if plain else None,
                "median_tokens_per_cpu_s": statistics.median(cpu_runs[v]), "cpu_runs": cpu_runs[v],
                "cpu_ratio_to_baseline": statistics.median(cpu_runs[v]) / statistics.median(cpu_runs[base]),
                "cpu_ratio_to_plain": statistics.median(cpu_runs[v]) / statistics.median(cpu_runs["plain"]) if plain else None}
            for v, r in runs.items()
        },
    }


PROFILED = ("lightning", "plain")


def profile_pretrain(workload: pretrain.PretrainWorkload, warmup: int, profile_steps: int) -> dict[str, dict[str, float]]:
    """Milliseconds per step by phase (``_pretrain_speed_workload.BREAKDOWN_ROWS``) of ``PROFILED``, rank 0, under ``torch.profiler``."""
    steps = warmup + profile_steps + 1
    return {
        variant: _spawn(variant, steps, timeout=180 + 20 * steps, workload=workload,
                        profile_window=pretrain.ProfileWindow(warmup, profile_steps))[0]
        for variant in PROFILED
    }


def print_profile(profile: dict[str, dict[str, float]]) -> None:
    print(f"\nWhere a step's time goes, ms per step (rank 0 for {PROFILED[0]}; under torch.profiler, which slows both):\n")
    print(f"| phase | {' | '.join(PROFILED)} | difference |")
    print("|---|---|---|---|")
    first, second = (profile[v] for v in PROFILED)
    for row in first:
        print(f"| {row} | {first[row]:.1f} | {second.get(row, 0.0):.1f} | {first[row] - second.get(row, 0.0):+.1f} |")


if __name__ == "__main__":
    main()
