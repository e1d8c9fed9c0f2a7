"""Sharding plans for the sharding group: constraints, planning, plan summaries. No Lightning imports."""

from lightning_recsys.planner.plan import TableConstraints, make_sharding_plan, plan_rows, summarize_plan

__all__ = ["TableConstraints", "make_sharding_plan", "plan_rows", "summarize_plan"]
