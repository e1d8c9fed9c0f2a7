"""Overhead of Trainer + TwoDRecStrategy against hand-written TorchRec training loops.

Same model, same data (pre-generated batches, so data generation does not count), same plan,
2 processes, 1D, gloo on CPU. Variants, run interleaved several times, at each global batch:

* ``raw``: ``DistributedModelParallel`` and a plain loop (forward, BCE, backward, dense step);
* ``raw_pipeline``: the same model and optimizer driven by TorchRec's ``TrainPipelineSparseDist``
  (the next batch's input distribution overlaps this batch's step);
* ``lightning``: ``Trainer(strategy=TwoDRecStrategy())`` with its defaults (``pipeline="sparse_dist"``,
  ``GuardConfig(validate_inputs="error")``: the per-step input check and the batch handshake between ranks);
* ``lightning_off``: the same with ``pipeline="off"``.

    python benchmarks/overhead.py                      # batches 1024 and 8192; Markdown; JSON in benchmarks/results/
    python benchmarks/overhead.py --global-batch 1024 --steps 150
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


def _entry(variant: str, rank: int, port: int, steps: int, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD_SIZE), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)  # 2 processes on 2 cores: one thread each, for both variants
    if variant.startswith("raw"):
        stamps = _raw(rank, steps, pipelined=variant == "raw_pipeline")
    else:
        stamps = _lightning(rank, steps, "off" if variant == "lightning_off" else "sparse_dist")
    buffer = io.BytesIO()
    torch.save(stamps, buffer)
    results.put((rank, buffer.getvalue()))


VARIANTS = ("raw", "raw_pipeline", "lightning", "lightning_off")


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
    parser.add_argument("--global-batch", type=int, nargs="+", default=[GLOBAL_BATCH, 8192])
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    main()
