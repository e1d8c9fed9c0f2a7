"""Reading a TorchRec ``ShardingPlan``: one row per table, as checkpoints record it and logs print it.

No Lightning imports.
"""

from __future__ import annotations

from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingPlan


def plan_rows(plan: ShardingPlan) -> list[dict[str, object]]:
    """One row per table: module, table, sharding type, compute kernel and group-local ranks."""
    rows: list[dict[str, object]] = []
    for module_fqn, module_plan in plan.plan.items():
        if not isinstance(module_plan, EmbeddingModuleShardingPlan):
            continue
        for table, sharding in module_plan.items():
            rows.append(
                {
                    "module": module_fqn,
                    "table": table,
                    "sharding_type": sharding.sharding_type,
                    "compute_kernel": sharding.compute_kernel,
                    "ranks": list(sharding.ranks or []),
                }
            )
    return rows


def summarize_plan(plan: ShardingPlan) -> str:
    """A small fixed-width table of the plan, for logs."""
    rows = plan_rows(plan)
    header = ("module", "table", "sharding_type", "kernel", "ranks")
    body = [(str(r["module"]), str(r["table"]), str(r["sharding_type"]), str(r["compute_kernel"]), str(r["ranks"])) for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)
