"""TorchRec sharders that expose every sharding type that runs on the current device."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.distributed.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
from torchrec.distributed.types import LazyAwaitable, ModuleSharder, ParameterSharding, QuantizedCommCodecs, ShardingEnv, ShardingType
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import KeyedTensor

ALL_SHARDING_TYPES: tuple[str, ...] = (
    ShardingType.DATA_PARALLEL.value,
    ShardingType.TABLE_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_ROW_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
)
# Row-sharded tables pool with a reduce-scatter, which needs the same batch size on every rank.
ROW_SHARDED_TYPES: tuple[str, ...] = (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value, ShardingType.GRID_SHARD.value)
COLUMN_SHARDED_TYPES: tuple[str, ...] = (ShardingType.COLUMN_WISE.value, ShardingType.TABLE_COLUMN_WISE.value)
# TorchRec's stock sharders offer RW/TWRW only on CUDA (``BaseEmbeddingSharder.sharding_types`` in
# torchrec/distributed/embedding_types.py adds them for "cuda" only), but both run forward and
# backward on CPU/gloo and match unsharded training
# (tests/integration/test_strategy_integration.py::test_sharded_training_matches_unsharded), so we
# add them back there.
_CPU_EXTRA_TYPES: tuple[str, ...] = (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value)
# TorchRec's table_row_wise builds its intra-/cross-node process groups over the whole world unless
# given its own 2D environment, so inside one sharding group of a 2D layout it would mix replicas.
_1D_ONLY_TYPES: tuple[str, ...] = (ShardingType.TABLE_ROW_WISE.value,)


def _with_cpu_extras(stock: list[str], compute_device_type: str, candidates: tuple[str, ...]) -> list[str]:
    if compute_device_type != "cpu":
        return list(stock)
    return list(stock) + [t for t in candidates if t not in stock]


class _WorldDataParallelMixin:
    """Data-parallel tables are initialized and DDP-synchronized over the world, not the sharding group.

    Workaround: torchrec 1.8's ``ShardedEmbeddingBagCollection``/``ShardedEmbeddingCollection`` use
    ``env.process_group`` for their data-parallel tables: ``reset_parameters`` broadcasts with a
    global ``src=0`` over it (under 2D every sharding group but the first raises "Global rank 0 is
    not part of group"), and ``init_data_parallel`` wraps those lookups in DDP over it (so replicas
    in other groups would never see each other's gradients). Every rank builds the same tables in
    the same order, so both are valid over the world, where they keep every copy equal.
    """

    _env: ShardingEnv

    @contextmanager
    def _world_env(self) -> Iterator[None]:
        group_env, world = self._env, dist.group.WORLD
        if group_env.process_group is not None and world is not None and group_env.process_group is not world:
            self._env = ShardingEnv.from_process_group(world)
        try:
            yield
        finally:
            self._env = group_env

    def reset_parameters(self) -> None:
        with self._world_env():
            super().reset_parameters()  # type: ignore[misc]

    def init_data_parallel(self) -> None:
        with self._world_env():
            super().init_data_parallel()  # type: ignore[misc]


class _ShardedEmbeddingBagCollection(_WorldDataParallelMixin, ShardedEmbeddingBagCollection):
    """Its pooled output keeps the unsharded module's key order.

    TorchRec's sharded EBC concatenates its output by sharding type, then by rank (a table_wise plan
    that puts ``t1`` on rank 0 returns ``[f1, f0]``), while the unsharded module returns its tables'
    order. A model reading ``ebc(kjt).values()`` by position (as the ranker in docs/models-and-metrics.md does) would
    then feed its dense layers permuted columns: a different model than the one built, whose meaning
    changes with the plan (a checkpoint resharded to another world is silently wrong).
    """

    def __init__(self, module: EmbeddingBagCollection, *args: Any, **kwargs: Any) -> None:
        self._unsharded_names = [n for names in get_embedding_names_by_table(module.embedding_bag_configs()) for n in names]
        self._reorder_for: tuple[str, ...] | None = None  # the sharded order _reorder_index was made for
        self._reorder_index: torch.Tensor | None = None
        super().__init__(module, *args, **kwargs)

    def _in_unsharded_order(self, output: KeyedTensor) -> KeyedTensor:
        names = tuple(output.keys())
        if self._reorder_for != names:
            offsets, start = {}, 0
            for name, dim in zip(names, output.length_per_key()):
                offsets[name] = (start, dim)
                start += dim
            columns = [torch.arange(o, o + d) for o, d in (offsets[n] for n in self._unsharded_names)]
            self._reorder_index = torch.cat(columns).to(output.values().device)
            self._reorder_for = names
        assert self._reorder_index is not None
        dims = dict(zip(names, output.length_per_key()))
        return KeyedTensor(
            keys=list(self._unsharded_names),
            length_per_key=[dims[n] for n in self._unsharded_names],
            values=output.values().index_select(output.key_dim(), self._reorder_index),
            key_dim=output.key_dim(),
        )

    def _reordered(self, awaitable: LazyAwaitable[KeyedTensor]) -> LazyAwaitable[KeyedTensor]:
        # Only when the orders differ (and name the same keys): otherwise TorchRec's output is returned as it is.
        if self._embedding_names != self._unsharded_names and sorted(self._embedding_names) == sorted(self._unsharded_names):
            awaitable.callbacks.append(self._in_unsharded_order)
        return awaitable

    def output_dist(self, ctx: Any, output: Any) -> LazyAwaitable[KeyedTensor]:
        return self._reordered(super().output_dist(ctx, output))

    def compute_and_output_dist(self, ctx: Any, input: Any) -> LazyAwaitable[KeyedTensor]:
        return self._reordered(super().compute_and_output_dist(ctx, input))


class _ShardedEmbeddingCollection(_WorldDataParallelMixin, ShardedEmbeddingCollection):
    pass


class _AllowListMixin:
    """A sharder that offers only the sharding types of an allow-list (None: all it would offer)."""

    _extra_cpu_types: tuple[str, ...] = ()

    def __init__(self, allowed_sharding_types: list[str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # type: ignore[call-arg]
        self._allowed = allowed_sharding_types

    def sharding_types(self, compute_device_type: str) -> list[str]:
        stock = super().sharding_types(compute_device_type)  # type: ignore[misc]
        types = _with_cpu_extras(stock, compute_device_type, self._extra_cpu_types)
        return [t for t in types if self._allowed is None or t in self._allowed]


class RecSysEmbeddingBagCollectionSharder(_AllowListMixin, EmbeddingBagCollectionSharder):
    """EmbeddingBagCollection sharder with row-wise types on CPU and an optional allow-list."""

    _extra_cpu_types = _CPU_EXTRA_TYPES

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedEmbeddingBagCollection:
        # As the base sharder's shard(), with the subclass that keeps data-parallel tables world-wide.
        return _ShardedEmbeddingBagCollection(
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
            sharded_module_order_overwrite=self._sharded_module_order_overwrite,
        )


class RecSysEmbeddingCollectionSharder(_AllowListMixin, EmbeddingCollectionSharder):
    """EmbeddingCollection (sequence) sharder with an optional allow-list; no data_parallel on CPU.

    TorchRec 1.8 offers data_parallel for sequence tables, but on CPU its lookup returns one pooled
    row per example instead of one row per id, and the first forward fails in
    ``construct_jagged_tensors`` ("split_with_sizes expects split_sizes to sum exactly to ...").
    The planners (ours makes small tables data_parallel) must not choose it there.
    """

    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = super().sharding_types(compute_device_type)
        if compute_device_type == "cpu":
            return [t for t in types if t != ShardingType.DATA_PARALLEL.value]
        return types

    def shard(
        self,
        module: EmbeddingCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedEmbeddingCollection:
        # As the base sharder's shard(), with the subclass that keeps data-parallel tables world-wide.
        return _ShardedEmbeddingCollection(
            module,
            params,
            env,
            self.fused_params,
            device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            use_index_dedup=self._use_index_dedup,
            module_fqn=module_fqn,
        )


def supported_sharding_types(compute_device_type: str, *, two_d: bool = False) -> list[str]:
    """Sharding types the EmbeddingBagCollection sharder can use on ``compute_device_type`` (under 2D)."""
    types = RecSysEmbeddingBagCollectionSharder().sharding_types(compute_device_type)
    return [t for t in types if not (two_d and t in _1D_ONLY_TYPES)]


def validate_sharding_types(
    sharding_types: list[str], compute_device_type: str, argument: str, *, two_d: bool = False
) -> None:
    """Raise if ``sharding_types`` names a type that is unknown or does not run on this device (or 2D)."""
    supported = supported_sharding_types(compute_device_type, two_d=two_d)
    for sharding_type in sharding_types:
        if sharding_type not in ALL_SHARDING_TYPES:
            raise ValueError(f"{argument} contains {sharding_type!r}, which is not one of {list(ALL_SHARDING_TYPES)}.")
        if two_d and sharding_type in _1D_ONLY_TYPES:
            raise ValueError(
                f"{argument} contains {sharding_type!r}, which is not supported under 2D parallelism "
                "(sharding_group_size < world size): TorchRec builds its node-level groups over the whole world. "
                f"Use 'row_wise' instead; supported under 2D: {supported}."
            )
        if sharding_type not in supported:
            raise ValueError(
                f"{argument} contains {sharding_type!r}, which TorchRec does not support on "
                f"{compute_device_type!r}; supported there: {supported}."
            )


def make_sharders(
    fused_params: dict[str, Any],
    allowed_sharding_types: list[str] | None = None,
    *,
    qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
    index_dedup: bool = False,
) -> list[ModuleSharder[nn.Module]]:
    """Sharders for EmbeddingBagCollection and EmbeddingCollection, sharing one fused optimizer.

    The same sharders go to the planner and to DMP, so the planner's cost estimates see the
    QComms precisions in ``qcomm_codecs_registry``. ``index_dedup``: TorchRec's per-rank dedup of
    the sequence ids (``use_index_dedup``; EmbeddingCollection only, the bag sharder has none).
    """
    kwargs: dict[str, Any] = {"qcomm_codecs_registry": qcomm_codecs_registry}
    return [
        RecSysEmbeddingBagCollectionSharder(allowed_sharding_types, fused_params=dict(fused_params), **kwargs),
        RecSysEmbeddingCollectionSharder(allowed_sharding_types, fused_params=dict(fused_params), use_index_dedup=index_dedup, **kwargs),
    ]

