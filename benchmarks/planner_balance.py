"""TorchRec's default planner against BalancedPlanner on a Criteo-like table set with Zipf-skewed traffic.

    python benchmarks/planner_balance.py                       # groups of 8 and 64 ranks
    python benchmarks/planner_balance.py --group-sizes 8 --json out.json

26 tables whose sizes spread from 10^2 to 10^7 rows like Criteo's categorical features, dim 128,
on the meta device (no memory). Traffic is skewed twice, with explicit stats (no data is read):
across tables, ids per example follow a Zipf law over a seeded random order of the tables; within
a table, ids follow Zipf(1.05) over rows that a hash scattered. Both planners plan one sharding
group of fake CUDA ranks (8 per node; no process group, no GPU) with the same sharders, pooling
factors and kernels, and both plans are measured by the same ``build_plan_report``.

Prints a Markdown table of max/mean (imbalance) of storage, lookups and a2a bytes per rank, and
writes the numbers as JSON (default: benchmarks/results/planner_balance.json).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.planner import EmbeddingShardingPlanner

from lightning_recsys.parallel import (
    EmbeddingOptimizerConfig,
    make_sharders,
    supported_sharding_types,
)
from lightning_recsys.planner import (
    BalancedPlanner,
    PlanReport,
    TableStats,
    build_plan_report,
    torchrec_constraints,
)
from lightning_recsys.planner.torchrec_planner import quiet_torchrec_planner, torchrec_topology

# Criteo-like cardinalities: a few tables of millions of rows, a long tail of small ones.
CRITEO_LIKE_ROWS: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
MIN_ROWS, MAX_ROWS = 10**2, 10**7
KERNELS = ["fused", "dense"]  # dense: the data-parallel kernel
METRICS = ("storage_bytes", "lookups", "a2a_bytes")
LOCAL_WORLD_SIZE = 8
TARGET = 1.05


def criteo_like_tables(dim: int = 128) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=f"t_cat_{i}", embedding_dim=dim, num_embeddings=min(max(r, MIN_ROWS), MAX_ROWS), feature_names=[f"cat_{i}"])
        for i, r in enumerate(CRITEO_LIKE_ROWS)
    ]


def zipf_stats(
    tables: list[EmbeddingBagConfig], *, seed: int = 0, max_ids: float = 80.0, table_skew: float = 1.2, row_skew: float = 1.05
) -> dict[str, TableStats]:
    """Ids per example Zipf over tables (1 + (max_ids - 1) / k**table_skew), Zipf(row_skew) ids over hashed rows."""
    rng = random.Random(seed)
    order = list(range(len(tables)))
    rng.shuffle(order)
    stats = {}
    for k, index in enumerate(order, start=1):
        table = tables[index]
        pooling = 1.0 + (max_ids - 1.0) / k**table_skew
        shares, hot = _zipf_row_blocks(table.num_embeddings, row_skew, rng)
        stats[table.name] = TableStats(pooling_factor=round(pooling, 2), hot_row_share=hot, row_block_shares=shares)
    return stats


def _zipf_row_blocks(rows: int, s: float, rng: random.Random, blocks: int = 1024, head: int = 2000) -> tuple[tuple[float, ...], float]:
    """Lookup share per row block when Zipf(s) ranks land on random rows; and the hottest 1% rows' share."""
    head = min(head, rows)
    head_weights = [k**-s for k in range(1, head + 1)]
    tail = _zipf_integral(head + 0.5, rows + 0.5, s) if rows > head else 0.0
    total = sum(head_weights) + tail
    blocks = min(blocks, rows)
    shares = [tail / total / blocks] * blocks  # the tail spreads evenly
    for weight, row in zip(head_weights, rng.sample(range(rows), head)):
        shares[row * blocks // rows] += weight / total
    hot_rows = max(1, math.ceil(0.01 * rows))
    hot = sum(head_weights[:hot_rows]) + (_zipf_integral(head + 0.5, hot_rows + 0.5, s) if hot_rows > head else 0.0)
    norm = sum(shares)
    return tuple(x / norm for x in shares), min(1.0, hot / total)


def _zipf_integral(lo: float, hi: float, s: float) -> float:
    return math.log(hi / lo) if s == 1 else (hi ** (1 - s) - lo ** (1 - s)) / (1 - s)


class _Model(nn.Module):
    def __init__(self, tables: list[EmbeddingBagConfig]) -> None:
        super().__init__()
        self.sparse = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def compare(group_size: int, *, batch_size: int = 512, dim: int = 128, seed: int = 0) -> dict[str, Any]:
    """Plan the table set for one group with both planners; return both reports and their imbalances."""
    tables = criteo_like_tables(dim)
    stats = zipf_stats(tables, seed=seed)
    model = _Model(tables)
    sharders = make_sharders(EmbeddingOptimizerConfig().fused_params(), supported_sharding_types("cuda", two_d=True))
    local = min(LOCAL_WORLD_SIZE, group_size)
    reports: dict[str, PlanReport] = {}
    seconds: dict[str, float] = {}

    planners: dict[str, tuple[str, Any]] = {
        "default": (
            "TorchRec EmbeddingShardingPlanner",
            EmbeddingShardingPlanner(
                topology=torchrec_topology(group_size, local, "cuda"),
                batch_size=batch_size,
                constraints=torchrec_constraints(tables, stats=stats, compute_kernels=KERNELS),
                stats=[],
                debug=False,
            ),
        ),
        "balanced": (
            "BalancedPlanner",
            BalancedPlanner(
                sharding_group_size=group_size, group_ranks_per_node=local, compute_device="cuda", batch_size=batch_size,
                stats=stats, compute_kernels=KERNELS,
            ),
        ),
    }  # fmt: skip
    for name, (label, planner) in planners.items():
        start = time.perf_counter()
        with quiet_torchrec_planner():
            plan = planner.plan(model, sharders)
        seconds[name] = time.perf_counter() - start
        reports[name] = build_plan_report(
            plan, model, sharders, sharding_group_size=group_size, group_ranks_per_node=local, compute_device="cuda",
            batch_size=batch_size, stats=stats, planner=label,
        )  # fmt: skip
    return {
        "group_size": group_size,
        "imbalance": {name: {m: r.imbalance[m].ratio for m in METRICS} for name, r in reports.items()},
        "step_time_ms": {name: r.step_time_ms for name, r in reports.items()},
        "sharding_types": {name: _type_counts(r) for name, r in reports.items()},
        "planning_seconds": seconds,
        "reports": reports,
    }


def _type_counts(report: PlanReport) -> dict[str, int]:
    counts: dict[str, int] = {}
    for table in report.tables:
        counts[table.sharding_type] = counts.get(table.sharding_type, 0) + 1
    return counts


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| ranks | planner | storage max/mean | lookups max/mean | a2a bytes max/mean | est. step ms | sharding types | plan s |",
        "|---:|---|---:|---:|---:|---:|---|---:|",
    ]
    for result in results:
        for name in ("default", "balanced"):
            imb = result["imbalance"][name]
            types = ", ".join(f"{k} {v}" for k, v in sorted(result["sharding_types"][name].items()))
            lines.append(
                f"| {result['group_size']} | {name} | {imb['storage_bytes']:.3f} | {imb['lookups']:.3f} | {imb['a2a_bytes']:.3f} "
                f"| {result['step_time_ms'][name]:.3f} | {types} | {result['planning_seconds'][name]:.1f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--batch-size", type=int, default=512, help="examples per rank per step")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "planner_balance.json")
    parser.add_argument("--reports", action="store_true", help="also print both plan reports")
    args = parser.parse_args(argv)
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="torchrec")
    results = [compare(g, batch_size=args.batch_size, dim=args.dim, seed=args.seed) for g in args.group_sizes]
    print(markdown(results))
    for result in results:
        if result["group_size"] == 8:
            balanced, default = result["imbalance"]["balanced"], result["imbalance"]["default"]
            met = all(balanced[m] <= TARGET and balanced[m] < default[m] for m in ("lookups", "a2a_bytes"))
            print(f"\n8-rank target (balanced lookups and a2a bytes max/mean <= {TARGET} and below default): {'met' if met else 'NOT met'}")
        if args.reports:
            for report in result["reports"].values():
                print("\n" + report.to_table())
    args.json.parent.mkdir(parents=True, exist_ok=True)
    payload = [{**{k: v for k, v in r.items() if k != "reports"}, "reports": {n: rep.to_json() for n, rep in r["reports"].items()}} for r in results]
    args.json.write_text(json.dumps(payload, indent=2))
    print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
