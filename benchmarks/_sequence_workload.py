"""The sequence workload of the benchmarks: a ``SequenceRanker`` on synthetic Zipf histories over ~10^6 items.

Shared by the emulated-cluster driver (its options, the cost model's shape, the description) and the
job it launches (``_bench_job.py --workload sequence``: the model, the data, the plan's constraints).

The ids: ``SyntheticSequenceConfig(num_clusters=1)``, so every history item and candidate is one
Zipf(``--zipf-exponent``) draw over all ``--items`` rows (scattered by a fixed permutation, as after
hashing): exactly the distribution the cost model's union formula assumes. Histories have exactly
``--history-length`` items (min = max), so the ids per example are known. The item table (history
and candidate: one table, two features) is row-wise, so every rank sends the same share of its ids
to every other rank, as the cost model assumes; the action table (3 rows, fewer than the ranks) is
table-wise; the pooled context tables are row-wise.
"""

from __future__ import annotations

import argparse
from typing import Any

from _workload import positive_row_counts

SEQUENCE_OPTIONS: tuple[str, ...] = ("history_length", "items", "context_rows", "transformer_layers")
ACTION_TYPES = 3
DENSE_FEATURES = 4


def context_rows(text: str) -> list[int]:
    """``--context-rows`` ("100000,10000"): rows of each pooled context table."""
    return positive_row_counts(text, "--context-rows", "100000,10000")


def add_sequence_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sequence workload (--workload sequence)")
    group.add_argument("--history-length", type=int, default=64, help="items per history (every history has exactly this many)")
    group.add_argument("--items", type=int, default=1_000_000, help="rows of the item table (history and candidate)")
    group.add_argument("--context-rows", default="100000,10000", help="rows of each pooled context table")
    group.add_argument("--transformer-layers", type=int, default=1)


def sequence_argv(args: argparse.Namespace) -> list[str]:
    """The sequence workload's own options as command-line arguments."""
    return [item for name in SEQUENCE_OPTIONS for item in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]


def check_sequence_arguments(args: argparse.Namespace) -> None:
    context_rows(args.context_rows)
    if args.history_length < 1 or args.items < 2 or args.transformer_layers < 1:
        raise ValueError(
            f"--history-length={args.history_length}, --items={args.items} and --transformer-layers={args.transformer_layers} "
            "must be >= 1, >= 2 and >= 1."
        )
    if args.embedding_dim % 4:
        raise ValueError(f"--embedding-dim={args.embedding_dim} must be a multiple of 4 (FBGEMM's sharded kernels).")


def data_config(args: argparse.Namespace, batches: int) -> Any:
    from lightning_recsys.data import SyntheticSequenceConfig

    return SyntheticSequenceConfig(
        num_items=args.items, num_clusters=1, zipf_exponent=args.zipf_exponent, min_history_length=args.history_length,
        max_history_length=args.history_length, num_action_types=ACTION_TYPES, context_table_sizes=context_rows(args.context_rows),
        num_dense_features=DENSE_FEATURES, global_batch_size=args.global_batch_size, train_batches=batches, val_batches=0,
        test_batches=0, seed=getattr(args, "seed", 0),
    )  # fmt: skip


def model(args: argparse.Namespace, config: Any) -> Any:
    """A small TransAct-style ranker: one encoder layer over the newest ``--history-length`` actions, tables on meta."""
    from lightning_recsys.models import SequenceRanker

    return SequenceRanker(
        item_table_size=config.num_items, num_action_types=config.num_action_types, context_feature_names=config.context_feature_names,
        context_table_sizes=list(config.context_table_sizes), num_dense_features=config.num_dense_features,
        embedding_dim=args.embedding_dim, max_history=args.history_length, num_layers=args.transformer_layers, num_heads=2,
        feedforward_dim=4 * args.embedding_dim, dropout=0.0, newest_tokens=4, over_arch_layer_sizes=[64, 32, 1],
        embedding_device="meta", dense_optimizer="sgd",
    )  # fmt: skip


def planning(config: Any) -> Any:
    """Row-wise item and context tables, a table-wise action table (it has fewer rows than there are ranks)."""
    from lightning_recsys import PlanningConfig, TableConstraints

    row_wise = ["item", *(f"t_{name}" for name in config.context_feature_names)]
    constraints = {t: TableConstraints(sharding_types=["row_wise"]) for t in row_wise}
    constraints["action"] = TableConstraints(sharding_types=["table_wise"])
    return PlanningConfig(sharding_types=["row_wise", "table_wise"], table_constraints=constraints)


def unique_fraction(batches: list[Any], rank: int, world_size: int) -> dict[str, float]:
    """Per table, the mean fraction of distinct ids in ``rank``'s slice of each batch (what index dedup keeps)."""
    import torch

    from lightning_recsys.data import slice_batch

    tables = {"item": ("history_item_id", "candidate_item_id"), "action": ("history_action",)}
    sums = dict.fromkeys(tables, 0.0)
    for batch in batches:
        size = batch.labels.shape[0]
        local = slice_batch(batch, rank * size // world_size, (rank + 1) * size // world_size).sparse
        for table, features in tables.items():
            ids = torch.cat([local[f].values() for f in features])
            sums[table] += ids.unique().numel() / max(1, ids.numel())
    return {t: s / max(1, len(batches)) for t, s in sums.items()}


def model_shape(args: argparse.Namespace, world_size: int, dense_param_bytes: float) -> Any:
    """The workload as the cost model's ``ModelShape`` (SGD: no optimizer state synced)."""
    from lightning_recsys.planner.cost import Feature, ModelShape

    s, d, length = args.zipf_exponent, args.embedding_dim, args.history_length
    features = (
        # The candidate shares the item table: one more id per example, deduped with the history.
        Feature(name="item", rows=args.items, dim=d, ids_per_example=length + 1, pooled=False, zipf_exponent=s),
        Feature(name="action", rows=ACTION_TYPES, dim=d, ids_per_example=length, pooled=False, zipf_exponent=0.0),
        *(Feature(name=f"t_context_{i}", rows=r, dim=d, ids_per_example=1, zipf_exponent=s) for i, r in enumerate(context_rows(args.context_rows))),
    )  # fmt: skip
    return ModelShape(name="emulated sequence", batch_per_rank=args.global_batch_size // world_size, features=features,
                      dense_param_bytes=dense_param_bytes, optimizer_state_per_row=0.0)  # fmt: skip


def describe(args: argparse.Namespace) -> str:
    return (
        f"Model: SequenceRanker, {args.transformer_layers} encoder layer(s) over {args.history_length}-item histories, item table "
        f"{args.items:,} rows (history + candidate) and action table {ACTION_TYPES} rows x dim {args.embedding_dim}, pooled context "
        f"tables {context_rows(args.context_rows)}, on meta; item and context tables row-wise; Zipf({args.zipf_exponent:g}) ids; "
        f"global batch {args.global_batch_size}; {args.warmup_steps} warm-up + {args.steps} timed steps per run."
    )


def model_json(args: argparse.Namespace) -> dict[str, Any]:
    return {"workload": "sequence", "items": args.items, "history_length": args.history_length, "action_types": ACTION_TYPES,
            "context_rows": context_rows(args.context_rows), "embedding_dim": args.embedding_dim,
            "global_batch_size": args.global_batch_size, "zipf_exponent": args.zipf_exponent,
            "transformer_layers": args.transformer_layers}  # fmt: skip


def dense_param_bytes(args: argparse.Namespace) -> float:
    """Bytes of the model's dense parameters (what the dense all-reduce carries), from the model built on meta."""
    ranker = model(args, data_config(args, 1))
    return float(sum(4 * p.numel() for n, p in ranker.named_parameters() if "_embeddings." not in n))
