"""The pretraining workload of the benchmarks: a ``SequencePretrainer`` on synthetic sequences of Beauty-like lengths.

Shared by the emulated-cluster driver (its options, the cost model's shape, the description) and the job it
launches (``_bench_job.py --workload pretrain``: the model, the data, the plan's constraints).

The sequences: ``--pretrain-users`` users, each ``5 + Geometric`` items long with mean ``--mean-length`` (Amazon
Beauty after its 5-core filter: 22,363 users, mean 8.9 items, a long tail), items i.i.d. Zipf(``--zipf-exponent``)
over ``--items`` rows, scattered by a fixed permutation (as after hashing). They are split leave-one-out and
batched by ``SequencePretrainDataModule`` (``lightning_recsys.data.sequences``), which gives every rank's batch
one pool of ``--num-negatives`` uniform negatives. The item table (history, targets, negatives: one table, three
features) is row-wise, so every rank sends the same share of its ids to every other rank.

The cost model's shape is learned from the data (``PretrainWorkload.from_batches`` on the first training
batches of every rank): tokens per example, the pool, and the Zipf exponent that matches the batches' distinct ids.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

PRETRAIN_OPTIONS: tuple[str, ...] = ("items", "pretrain_users", "mean_length", "max_length", "num_negatives", "transformer_layers")
MIN_LENGTH = 5  # Beauty's 5-core filter


def add_pretrain_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("pretraining workload (--workload pretrain; also --items, --transformer-layers)")
    group.add_argument("--pretrain-users", type=int, default=40_000, help="users (one sequence each)")
    group.add_argument("--mean-length", type=float, default=8.9, help="mean items per user (Beauty: 8.9), at least 5 each")
    group.add_argument(
        "--max-length", type=int, default=20,
        help="SequencePretrainer.max_length (newest input items read; 20 holds all but the longest 1.3%% of these sequences' inputs)",
    )
    group.add_argument("--num-negatives", type=int, default=256, help="uniform negatives per rank's batch (one shared pool)")


def pretrain_argv(args: argparse.Namespace) -> list[str]:
    return [item for name in PRETRAIN_OPTIONS for item in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]


def check_pretrain_arguments(args: argparse.Namespace) -> None:
    if args.pretrain_users < 1 or args.items < 2 or args.max_length < 1 or args.num_negatives < 0 or args.mean_length < MIN_LENGTH:
        raise ValueError(
            f"--pretrain-users={args.pretrain_users}, --items={args.items}, --max-length={args.max_length}, "
            f"--num-negatives={args.num_negatives} and --mean-length={args.mean_length} must be >= 1, >= 2, >= 1, >= 0 and >= {MIN_LENGTH}."
        )
    if args.embedding_dim % 4:
        raise ValueError(f"--embedding-dim={args.embedding_dim} must be a multiple of 4 (FBGEMM's sharded kernels).")


def sequences(args: argparse.Namespace) -> Any:
    """Every user's items (``UserSequences``), from ``--seed``: the same on every process."""
    from lightning_recsys.data.sequences.reader import UserSequences

    rng = np.random.default_rng([getattr(args, "seed", 0), 42])
    extra = args.mean_length - MIN_LENGTH
    longer = rng.geometric(1 / (extra + 1), args.pretrain_users) - 1 if extra > 0 else np.zeros(args.pretrain_users, np.int64)
    lengths = MIN_LENGTH + longer
    weights = np.arange(1, args.items + 1, dtype=np.float64) ** -args.zipf_exponent
    cdf = np.cumsum(weights / weights.sum())
    ranks = np.minimum(np.searchsorted(cdf, rng.random(int(lengths.sum()))), args.items - 1)
    items = rng.permutation(args.items)[ranks]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return UserSequences(items=items.astype(np.int64), offsets=offsets, user_ids=np.arange(1, args.pretrain_users + 1),
                         num_items=args.items)  # fmt: skip


def datamodule(args: argparse.Namespace) -> Any:
    from lightning_recsys.data.sequences import SequencePretrainDataModule

    class ZipfSequences(SequencePretrainDataModule):
        def _load(self) -> Any:
            return sequences(args)

    return ZipfSequences(max_length=args.max_length, num_negatives=args.num_negatives, global_batch_size=args.global_batch_size,
                         shuffle=False, seed=getattr(args, "seed", 0))  # fmt: skip


def model(args: argparse.Namespace) -> Any:
    """A small SASRec (``--transformer-layers`` blocks, one head, no dropout), the item table on meta."""
    from lightning_recsys.models import SequencePretrainer

    return SequencePretrainer(
        num_items=args.items, embedding_dim=args.embedding_dim, max_length=args.max_length, num_layers=args.transformer_layers,
        num_heads=1, dropout=0.0, embedding_device="meta", dense_optimizer="sgd",
    )  # fmt: skip


def planning() -> Any:
    from lightning_recsys import PlanningConfig, TableConstraints

    return PlanningConfig(sharding_types=["row_wise"], table_constraints={"item": TableConstraints(sharding_types=["row_wise"])})


def training_batches(args: argparse.Namespace, world_size: int, count: int, data: Any = None) -> dict[int, list[Any]]:
    """The first ``count`` training batches of every rank."""
    data = data or datamodule(args)
    out = {}
    for rank in range(world_size):
        batches = iter(data._dataset("train", rank, world_size))
        out[rank] = [next(batches) for _ in range(count)]
    return out


def unique_fraction(batches: list[Any]) -> dict[str, float]:
    """The mean fraction of distinct ids of the item table (all three features) in each batch: what index dedup keeps."""
    import torch

    sums = 0.0
    for batch in batches:
        ids = torch.cat([batch.sparse[f].values() for f in ("item_id", "next_item_id", "negative_item_id")])
        sums += ids.unique().numel() / max(1, ids.numel())
    return {"item": sums / max(1, len(batches))}


def model_shape(args: argparse.Namespace, world_size: int) -> Any:
    """The cost model's ``ModelShape``, learned from every rank's first 4 training batches (SGD: no optimizer state synced)."""
    from lightning_recsys.planner.cost import PretrainWorkload

    batches = [b for per_rank in training_batches(args, world_size, 4).values() for b in per_rank]
    workload = PretrainWorkload.from_batches(batches, items=args.items, dim=args.embedding_dim)
    args.learned_workload = workload
    return workload.model_shape(dense_param_bytes=dense_param_bytes(args), name="emulated pretraining", optimizer_state_per_row=0.0)


def dense_param_bytes(args: argparse.Namespace) -> float:
    return float(sum(4 * p.numel() for n, p in model(args).named_parameters() if "_embeddings." not in n))


def describe(args: argparse.Namespace) -> str:
    learned = getattr(args, "learned_workload", None)
    fitted = (f"; learned from the batches: {learned.tokens_per_example:.2f} input tokens per example, Zipf exponent "
              f"{learned.zipf_exponent:.2f}" if learned is not None else "")  # fmt: skip
    return (
        f"Model: SequencePretrainer (SASRec, {args.transformer_layers} block(s), max length {args.max_length}), item table "
        f"{args.items:,} rows x dim {args.embedding_dim} on meta, row-wise; {args.pretrain_users:,} users of mean length "
        f"{args.mean_length:g} (at least {MIN_LENGTH}), Zipf({args.zipf_exponent:g}) items; {args.num_negatives} uniform negatives "
        f"per rank's batch; global batch {args.global_batch_size}; {args.warmup_steps} warm-up + {args.steps} timed steps per run{fitted}."
    )


def model_json(args: argparse.Namespace) -> dict[str, Any]:
    learned = getattr(args, "learned_workload", None)
    return {"workload": "pretrain", **{name: getattr(args, name) for name in PRETRAIN_OPTIONS}, "embedding_dim": args.embedding_dim,
            "global_batch_size": args.global_batch_size, "zipf_exponent": args.zipf_exponent,
            "learned": None if learned is None else {"tokens_per_example": learned.tokens_per_example,
                                                     "zipf_exponent": learned.zipf_exponent, "num_negatives": learned.num_negatives}}  # fmt: skip
