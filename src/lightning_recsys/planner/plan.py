"""Making a sharding plan with TorchRec's planner, and describing it."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ModuleSharder, ShardingPlan

from lightning_recsys.parallel.sharders import ALL_SHARDING_TYPES

_COMPUTE_KERNELS = ("dense", "fused", "fused_uvm", "fused_uvm_caching", "quant", "key_value")


@dataclass(kw_only=True)
class TableConstraints:
    """Planner constraints for one embedding table, keyed by table name in the strategy's config.

    Args:
        sharding_types: the sharding types the planner may choose from for this table.
        compute_kernels: the TorchRec compute kernels it may choose from (``fused`` on CPU and GPU).
        min_partition: the smallest column block for column-wise sharding.
        pooling_factor: the mean number of ids per example, for the planner's cost estimates.
    """

    sharding_types: list[str] | None = None
    compute_kernels: list[str] | None = None
    min_partition: int | None = None
    pooling_factor: float | None = None

    def __post_init__(self) -> None:
        for sharding_type in self.sharding_types or []:
            if sharding_type not in ALL_SHARDING_TYPES:
                raise ValueError(
                    f"TableConstraints(sharding_types=[..., {sharding_type!r}, ...]): not one of "
                    f"{list(ALL_SHARDING_TYPES)}."
                )
        for kernel in self.compute_kernels or []:
            if kernel not in _COMPUTE_KERNELS:
                raise ValueError(f"TableConstraints(compute_kernels=[..., {kernel!r}, ...]): not one of {list(_COMPUTE_KERNELS)}.")
        if self.min_partition is not None and self.min_partition < 1:
            raise ValueError(f"TableConstraints(min_partition={self.min_partition}) must be >= 1.")
        if self.pooling_factor is not None and not self.pooling_factor > 0:
            raise ValueError(f"TableConstraints(pooling_factor={self.pooling_factor}) must be > 0.")

    def to_torchrec(self) -> ParameterConstraints:
        kwargs: dict[str, object] = {}
        if self.sharding_types is not None:
            kwargs["sharding_types"] = list(self.sharding_types)
        if self.compute_kernels is not None:
            kwargs["compute_kernels"] = list(self.compute_kernels)
        if self.min_partition is not None:
            kwargs["min_partition"] = self.min_partition
        if self.pooling_factor is not None:
            kwargs["pooling_factors"] = [self.pooling_factor]
        return ParameterConstraints(**kwargs)  # type: ignore[arg-type]


def make_sharding_plan(
    module: nn.Module,
    sharders: list[ModuleSharder[nn.Module]],
    *,
    sharding_group_size: int,
    local_world_size: int,
    compute_device: str,
    constraints: dict[str, TableConstraints] | None = None,
    batch_size: int | None = None,
) -> ShardingPlan:
    """Plan ``module`` for one sharding group, on global rank 0, and broadcast it to every rank.

    The plan's ranks are group-local (0..sharding_group_size-1). It is broadcast over WORLD: a
    broadcast over a subgroup breaks TorchRec's ``collective_plan`` (torchrec
    ``distributed/collective_utils.py`` ``invoke_on_rank_and_broadcast_result`` compares the group-local
    ``pg.rank()`` with its rank but passes that number to ``broadcast_object_list`` as a global ``src``).
    """
    unknown = set(constraints or {}) - set(_table_names(module))
    if unknown:
        raise ValueError(
            f"table_constraints names tables that the model does not have: {sorted(unknown)}; "
            f"the model's tables are {sorted(_table_names(module))}."
        )
    topology = TopologyFactory.create_topology(
        TrainerConfig(world_size=sharding_group_size, local_world_size=min(local_world_size, sharding_group_size)),
        kernel_config=KernelConfig(compute_device=compute_device),
    )
    planner = EmbeddingShardingPlanner(
        topology=topology,
        constraints={name: c.to_torchrec() for name, c in (constraints or {}).items()},
        **({"batch_size": batch_size} if batch_size else {}),
    )
    if dist.is_initialized():
        return planner.collective_plan(module, sharders, dist.group.WORLD)
    return planner.plan(module, sharders)


def _table_names(module: nn.Module) -> list[str]:
    names: list[str] = []
    for sub in module.modules():
        if isinstance(sub, EmbeddingBagCollection):
            names += [t.name for t in sub.embedding_bag_configs()]
        elif isinstance(sub, EmbeddingCollection):
            names += [t.name for t in sub.embedding_configs()]
    return names


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
