"""Train the default DLRM ranker on synthetic click logs with TwoDRecStrategy (the `make demo` job as a plain script).

    python examples/train_synthetic_dlrm.py                 # 2 CPU processes, gloo
    python examples/train_synthetic_dlrm.py --tiny          # seconds; used by the smoke test
    python examples/train_synthetic_dlrm.py --accelerator gpu --devices 8
    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --master-addr 127.0.0.1 --master-port 29500 \
        examples/train_synthetic_dlrm.py --devices 2 --num-nodes 2          # 2D; run node-rank 1 too
    torchrun --nproc-per-node 2 --max-restarts 3 examples/train_synthetic_dlrm.py \
        --checkpoint-dir checkpoints --every-n-train-steps 50 --ckpt-path last   # restarted workers resume
"""

from __future__ import annotations

import argparse
import json

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_recsys import EmbeddingOptimizerConfig, PlanningConfig, ReplicaSyncConfig, TwoDRecStrategy
from lightning_recsys.data import SyntheticClickLogDataModule
from lightning_recsys.models import DLRMRanker


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu", "cuda"])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-batches", type=int, default=150, help="global batches per epoch")
    parser.add_argument("--val-batches", type=int, default=20)
    parser.add_argument("--global-batch-size", type=int, default=512)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--table-rows", type=int, default=1000)
    parser.add_argument("--embedding-dim", type=int, default=16)
    parser.add_argument("--embedding-optimizer", default="rowwise_adagrad", choices=["sgd", "rowwise_adagrad", "adagrad", "adam"])
    parser.add_argument("--embedding-lr", type=float, default=0.1)
    parser.add_argument("--sharding-type", action="append", default=None, help="restrict the planner (repeatable)")
    parser.add_argument("--sharding-group-size", type=int, default=None, help="default: --devices (one group per node)")
    parser.add_argument("--layout", default="all_to_all_optimized", choices=["all_to_all_optimized", "all_reduce_optimized"])
    parser.add_argument("--sync-every-n-steps", type=int, default=1)
    parser.add_argument("--qcomms", default="fp32", choices=["fp32", "bf16", "fp16", "fp8", "int8"], help="embedding comms precision")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--metrics-json", default=None, help="also write the final metrics to this file (rank 0)")
    parser.add_argument("--checkpoint-dir", default=None, help="save DCP checkpoints here (ModelCheckpoint, save_last=True)")
    parser.add_argument("--every-n-train-steps", type=int, default=None, help="with --checkpoint-dir: also save every N steps")
    parser.add_argument("--ckpt-path", default=None, help='resume from this checkpoint, or "last" (the newest committed one)')
    parser.add_argument("--tiny", action="store_true", help="a few tiny batches; for smoke tests")
    args = parser.parse_args(argv)
    if args.every_n_train_steps is not None and args.checkpoint_dir is None:
        parser.error(f"--every-n-train-steps {args.every_n_train_steps} needs --checkpoint-dir (where to save)")
    if args.tiny:
        args.epochs, args.train_batches, args.val_batches, args.global_batch_size = 1, 4, 2, 32
        args.tables, args.table_rows, args.embedding_dim = 3, 50, 8
    return args


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    pl.seed_everything(args.seed, verbose=False)
    data = SyntheticClickLogDataModule(
        table_sizes=[args.table_rows] * args.tables,
        global_batch_size=args.global_batch_size,
        train_batches=args.train_batches,
        val_batches=args.val_batches,
        seed=args.seed,
    )
    model = DLRMRanker(
        table_sizes=data.config.table_sizes,
        num_dense_features=data.config.num_dense_features,
        embedding_dim=args.embedding_dim,
        dense_arch_layer_sizes=[32, args.embedding_dim],
        over_arch_layer_sizes=[32, 16, 1],
        embedding_device="meta",
    )
    strategy = TwoDRecStrategy(
        embedding_optimizer=EmbeddingOptimizerConfig(name=args.embedding_optimizer, lr=args.embedding_lr),
        planning=PlanningConfig(sharding_types=args.sharding_type),
        sharding_group_size=args.sharding_group_size,
        layout=args.layout,
        replica_sync=ReplicaSyncConfig(every_n_steps=args.sync_every_n_steps),
        qcomms=args.qcomms,
    )
    checkpoints = []
    if args.checkpoint_dir is not None:
        checkpoints.append(ModelCheckpoint(dirpath=args.checkpoint_dir, every_n_train_steps=args.every_n_train_steps, save_last=True))
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        max_epochs=args.epochs,
        enable_checkpointing=args.checkpoint_dir is not None,
        callbacks=checkpoints,
        logger=False,
        num_sanity_val_steps=0,
        log_every_n_steps=10,
    )
    trainer.fit(model, datamodule=data, ckpt_path=args.ckpt_path)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    if trainer.is_global_zero and not metrics:
        print(f"\nNothing left to train: the checkpoint {args.ckpt_path!r} resumed had finished {args.epochs} epochs.")
    elif trainer.is_global_zero:
        print(
            f"\nValidation after {args.epochs} epochs on {trainer.world_size} ranks: "
            f"AUC={metrics['val/auc']:.4f}  NE={metrics['val/ne']:.4f}  loss={metrics['val/loss']:.4f}"
        )
        print(f"Communication in the last training step (rank 0):\n{strategy.comm_accounting.summary()}")
        if args.metrics_json:
            with open(args.metrics_json, "w") as f:
                json.dump(metrics, f, indent=2)
    return metrics


if __name__ == "__main__":
    main()
