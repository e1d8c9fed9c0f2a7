"""Overhead of Trainer + TwoDRecStrategy against a hand-written TorchRec DMP training loop.

Same model, same data (pre-generated batches, so data generation does not count), same plan,
2 processes, 1D, gloo on CPU. Variants, run interleaved several times:

* ``raw``: ``DistributedModelParallel`` and a plain loop (forward, BCE, backward, dense step);
* ``lightning``: ``Trainer(strategy=TwoDRecStrategy(guard=GuardConfig(validate_inputs="off")))``;
* ``lightning+checks``: the default ``GuardConfig(validate_inputs="error")`` (the per-step input check and the
  batch handshake between ranks).

    python benchmarks/overhead.py                      # Markdown table; JSON in benchmarks/results/
    python benchmarks/overhead.py --global-batch 8192 --steps 150
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

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


def _raw(rank: int, steps: int) -> list[float]:
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
    for batch in _batches(rank, steps):
        optimizer.zero_grad()
        F.binary_cross_entropy_with_logits(dmp(batch), batch.labels).backward()
        optimizer.step()
        stamps.append(time.perf_counter())
    dist.destroy_process_group()
    return stamps


def _lightning(rank: int, steps: int, validate: str) -> list[float]:
    from lightning.pytorch import Callback, LightningDataModule, Trainer
    from torch.utils.data import DataLoader

    from lightning_recsys import EmbeddingOptimizerConfig, GuardConfig, PlanningConfig, TwoDRecStrategy

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
        guard=GuardConfig(validate_inputs=validate),
    )
    trainer = Trainer(
        accelerator="cpu", devices=WORLD_SIZE, strategy=strategy, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[stamps],
    )
    trainer.fit(_model(), datamodule=Prepared())
    return stamps.stamps


def _entry(variant: str, rank: int, port: int, steps: int, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD_SIZE), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)  # 2 processes on 2 cores: one thread each, for both variants
    stamps = _raw(rank, steps) if variant == "raw" else _lightning(rank, steps, "off" if variant == "lightning" else "error")
    buffer = io.BytesIO()
    torch.save(stamps, buffer)
    results.put((rank, buffer.getvalue()))


def run_variant(variant: str, steps: int, timeout: float = 300) -> float:
    """Steps per second after warm-up, on rank 0."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_entry, args=(variant, r, port, steps, results)) for r in range(WORLD_SIZE)]
    for p in procs:
        p.start()
    try:
        stamps = {}
        deadline = time.monotonic() + timeout
        while len(stamps) < WORLD_SIZE:
            rank, value = results.get(timeout=max(1.0, deadline - time.monotonic()))
            stamps[rank] = torch.load(io.BytesIO(value))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    rank0 = stamps[0]
    return (len(rank0) - WARMUP) / (rank0[-1] - rank0[WARMUP - 1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    args = parser.parse_args(argv)
    os.environ["OVERHEAD_GLOBAL_BATCH"] = str(args.global_batch)  # read by the spawned ranks
    variants = ["raw", "lightning", "lightning+checks"]
    runs: dict[str, list[float]] = {v: [] for v in variants}
    for repeat in range(args.repeats):
        for variant in variants:  # interleaved, so drift on a shared machine hits every variant alike
            runs[variant].append(run_variant(variant, args.steps))
            print(f"repeat {repeat + 1}/{args.repeats} {variant}: {runs[variant][-1]:.1f} steps/s", file=sys.stderr)
    raw = statistics.median(runs["raw"])
    summary = {
        "setup": {"world_size": WORLD_SIZE, "tables": TABLES, "rows": ROWS, "dim": DIM, "global_batch": args.global_batch,
                  "steps": args.steps, "warmup": WARMUP, "repeats": args.repeats, "sharding": "table_wise", "backend": "gloo (CPU)"},
        "variants": {
            v: {"median_steps_per_s": statistics.median(r), "min": min(r), "max": max(r), "runs": r,
                "ratio_to_raw": statistics.median(r) / raw}
            for v, r in runs.items()
        },
    }
    print(f"\nOverhead against a raw TorchRec loop ({WORLD_SIZE} processes, {TABLES} tables x {ROWS} rows x dim {DIM}, "
          f"global batch {args.global_batch}, table_wise, gloo on CPU; {args.repeats} interleaved runs of {args.steps} steps, "
          f"first {WARMUP} excluded)\n")
    print("| variant | median steps/s | spread (min-max) | median / raw |")
    print("|---|---|---|---|")
    for v, row in summary["variants"].items():
        print(f"| {v} | {row['median_steps_per_s']:.1f} | {row['min']:.1f}-{row['max']:.1f} | {row['ratio_to_raw']:.3f} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"overhead_batch{args.global_batch}.json").write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
