"""Single-device training throughput of TwoDRecStrategy: the number `make gpu-check` records on a GPU.

    python benchmarks/gpu_throughput.py --out results/gpu_throughput.json          # one CUDA device, nccl
    python benchmarks/gpu_throughput.py --accelerator cpu --tiny                   # a smoke run anywhere
    python benchmarks/gpu_throughput.py --pipeline off --out results/gpu_throughput_off.json   # pipeline on vs off

DLRM with 26 tables (Criteo-like widths), row-wise Adagrad embeddings, synthetic click logs.
Prints examples/s and the step time split from lightning_recsys.callbacks.RunSummary.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning.pytorch as pl

from lightning_recsys import EmbeddingOptimizerConfig, TwoDRecStrategy
from lightning_recsys.callbacks import RunSummary
from lightning_recsys.data import SyntheticClickLogDataModule
from lightning_recsys.models import DLRMRanker


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="gpu", choices=["gpu", "cuda", "cpu"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--qcomms", default="fp32")
    parser.add_argument("--pipeline", default="sparse_dist", choices=["sparse_dist", "off"], help="TwoDRecStrategy(pipeline=...)")
    parser.add_argument("--tiny", action="store_true", help="a few small steps, for a smoke test")
    parser.add_argument("--out", default=None, help="write the summary JSON here")
    args = parser.parse_args(argv)
    if args.tiny:
        args.steps, args.batch, args.rows, args.dim = 6, 64, 100, 8
    pl.seed_everything(0, verbose=False)
    tables = [args.rows] * 26
    data = SyntheticClickLogDataModule(table_sizes=tables, global_batch_size=args.batch, train_batches=args.steps, val_batches=1)
    model = DLRMRanker(
        table_sizes=tables, embedding_dim=args.dim, dense_arch_layer_sizes=[512, 256, args.dim],
        over_arch_layer_sizes=[512, 256, 1], embedding_device="meta",
    )
    summary = RunSummary(warmup_steps=min(20, args.steps // 3))
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=1, max_steps=args.steps, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[summary],
        strategy=TwoDRecStrategy(embedding_optimizer=EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.05), qcomms=args.qcomms,
                                pipeline=args.pipeline),
    )
    trainer.fit(model, datamodule=data)
    result = {"args": vars(args), **summary.summary}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()  # RunSummary prints the table
