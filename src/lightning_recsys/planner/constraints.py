"""Per-table planner constraints: ours (``TableConstraints``), hash partitions, and TorchRec's form of both.

Every planner here gets the same TorchRec ``ParameterConstraints`` (``torchrec_constraints``), so
TorchRec's default planner and ``BalancedPlanner`` plan on equal information. No Lightning imports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn
from torchrec import EmbeddingBagCollection
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.types import ModuleSharder, ShardingType
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from lightning_recsys.parallel.sharding import ALL_SHARDING_TYPES
from lightning_recsys.planner.stats import TableStats
from lightning_recsys.planner.tables import ModelTables

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


def pooling_factor_defaults(constraints: Mapping[str, TableConstraints] | None) -> dict[str, float]:
    """The pooling factors the constraints give, by table: what a table without observed stats assumes."""
    return {name: c.pooling_factor for name, c in (constraints or {}).items() if c.pooling_factor is not None}


def check_hash_partitions(
    hash_partitions: Mapping[str, int], tables: Sequence[BaseEmbeddingConfig], sharding_group_size: int
) -> None:
    """Raise ``ValueError`` unless every hashed table splits into whole, equal partition counts per rank."""
    rows_of = {t.name: t.num_embeddings for t in tables}
    for name, partitions in hash_partitions.items():
        if name not in rows_of:
            raise ValueError(f"hash_partitions names table {name!r}, which the model does not have; its tables are {sorted(rows_of)}.")
        rows = rows_of[name]
        if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
            raise ValueError(f"hash_partitions[{name!r}]={partitions!r} must be an integer >= 1.")
        if rows % partitions:
            raise ValueError(
                f"hash_partitions[{name!r}]={partitions}: table {name!r} has {rows} rows, which do not split into "
                f"{partitions} equal partitions; use a partition count that divides {rows}, e.g. "
                f"{_suggest_partitions(rows, sharding_group_size, partitions)}."
            )
        if partitions % sharding_group_size:
            raise ValueError(
                f"hash_partitions[{name!r}]={partitions} is not divisible by the sharding group size "
                f"{sharding_group_size}, so ranks would hold unequal numbers of partitions (and unequal load); "
                f"use a multiple of {sharding_group_size} that divides the table's {rows} rows, e.g. "
                f"{_suggest_partitions(rows, sharding_group_size, partitions)}."
            )


def _suggest_partitions(rows: int, group: int, wanted: int) -> str:
    """Partition counts near ``wanted`` that are multiples of ``group`` and divide ``rows``."""
    candidates = [p for p in range(group, min(rows, 64 * max(wanted, group)) + 1, group) if rows % p == 0]
    if not candidates:
        return f"none exists for {rows} rows: resize the table to a multiple of {group} rows"
    nearest = sorted(candidates, key=lambda p: (abs(p - wanted), p))[:2]
    return " or ".join(str(p) for p in sorted(nearest))


def torchrec_constraints(
    tables: Sequence[BaseEmbeddingConfig],
    *,
    stats: Mapping[str, TableStats],
    table_constraints: Mapping[str, TableConstraints] | None = None,
    hash_partitions: Mapping[str, int] | None = None,
    compute_kernels: Sequence[str] | None = None,
) -> dict[str, ParameterConstraints]:
    """TorchRec ``ParameterConstraints`` for every table: ours, the observed pooling factors, hash partitions.

    Give the same constraints to TorchRec's default planner to compare planners on equal information.
    """
    names = {t.name for t in tables}
    unknown = sorted(set(table_constraints or {}) - names)
    if unknown:
        raise ValueError(
            f"table_constraints names tables that the model does not have: {unknown}; the model's tables are {sorted(names)}."
        )
    constraints: dict[str, ParameterConstraints] = {}
    for table in tables:
        given = (table_constraints or {}).get(table.name)
        pc = given.to_torchrec() if given is not None else ParameterConstraints()
        table_stats = stats[table.name]
        pc.pooling_factors = [float(table_stats.pooling_factor)] * table_stats.features
        if compute_kernels is not None and (given is None or given.compute_kernels is None):
            pc.compute_kernels = list(compute_kernels)
        if table.name in (hash_partitions or {}):
            if pc.sharding_types is not None and ShardingType.ROW_WISE.value not in pc.sharding_types:
                raise ValueError(
                    f"table_constraints[{table.name!r}].sharding_types={pc.sharding_types} excludes 'row_wise', but "
                    f"hash_partitions[{table.name!r}] needs row-wise sharding on partition boundaries; allow 'row_wise' "
                    "or drop the table from hash_partitions."
                )
            pc.sharding_types = [ShardingType.ROW_WISE.value]
        constraints[table.name] = pc
    return constraints


def check_table_options(
    tables: ModelTables,
    sharders: Sequence[ModuleSharder[nn.Module]],
    compute_device: str,
    *,
    table_constraints: Mapping[str, TableConstraints] | None = None,
    hash_partitions: Mapping[str, int] | None = None,
    default_compute_kernels: Sequence[str] | None = None,
) -> None:
    """Raise ``ValueError`` for a table that no (sharding type, compute kernel) the planner may use fits.

    The sharders carry the allow-list (``PlanningConfig.sharding_types``, the 2D default) and what the
    device and module type offer; the table's ``TableConstraints`` and hash partitions narrow them.
    TorchRec's enumerator only raises "No available sharding type and compute kernel combination ...
    search above for warning logs" for such a table, naming neither the constraint nor what was left.
    """
    by_type = {sharder.module_type: sharder for sharder in sharders}
    for table, collection in zip(tables.configs, tables.collections):
        sharder = by_type.get(collection)
        if sharder is None:
            continue
        offered = {t: list(sharder.compute_kernels(t, compute_device)) for t in sharder.sharding_types(compute_device)}
        given = (table_constraints or {}).get(table.name)
        types = list(offered)
        if given is not None and given.sharding_types is not None:
            types = [t for t in types if t in given.sharding_types]
        if table.name in (hash_partitions or {}):
            types = [t for t in types if t == ShardingType.ROW_WISE.value]
        kernels = given.compute_kernels if given is not None and given.compute_kernels is not None else default_compute_kernels
        if any(kernels is None or set(offered[t]) & set(kernels) for t in types):
            continue
        asked = []
        if given is not None and given.sharding_types is not None:
            asked.append(f"sharding_types={given.sharding_types}")
        if given is not None and given.compute_kernels is not None:
            asked.append(f"compute_kernels={given.compute_kernels}")
        if table.name in (hash_partitions or {}):
            asked.append(f"row_wise only (hash_partitions[{table.name!r}])")
        if offered:
            may_use = f"The planner may use {offered} there"
        else:  # the allow-list leaves nothing that this module type runs on this device
            may_use = f"No sharding type of PlanningConfig(sharding_types) runs {collection.__name__} tables there"
            if compute_device == "cpu" and not issubclass(collection, EmbeddingBagCollection):
                may_use += " (data_parallel is not offered for sequence tables on CPU: TorchRec 1.8's lookup returns pooled rows)"
        raise ValueError(
            f"table {table.name!r} ({collection.__name__}): no sharding type and compute kernel are left for it on "
            f"{compute_device!r}. {may_use} (PlanningConfig(sharding_types) and, under 2D, "
            f"its default already applied), and the table asks for {', '.join(asked) or 'nothing more'}. Widen "
            f"table_constraints[{table.name!r}] or PlanningConfig(sharding_types) so that they share a sharding type "
            "and a compute kernel offered there."
        )
