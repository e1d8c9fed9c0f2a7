"""The embedding optimizer's state, normalized per table, so DCP can re-cut it for any plan.

What TorchRec exposes differs by sharding type (checked with torchrec 1.8.0 / fbgemm 1.8.0):

* model-parallel tables: ``dmp.fused_optimizer.state_dict()["state"][weight_key]`` holds
  ShardedTensors named ``"<table>.momentum1"`` (then FBGEMM's own names). Row-wise state (row-wise
  Adagrad) has global shape ``[rows]`` under table_wise/row_wise, but ``[rows * k]`` under
  column_wise with ``k`` column shards: every column shard keeps its own accumulator, stacked in
  column order (shard ``i`` at offset ``i * rows``). Point-wise state (Adagrad, Adam) has the
  weight's shape and shards.
* data_parallel tables: plain tensors stepped by a torch optimizer whose state is keyed by the
  parameter: RowWiseAdagrad ``sum [rows, 1]``, Adagrad ``sum``, Adam ``exp_avg``/``exp_avg_sq``,
  plus a ``step`` counter.

The normalized form, one entry per table and state, keyed ``embedding_optimizer.<weight key>.<state>``:

* ``rowwise_momentum1``: ``[rows]`` when every saved shard spans all columns (table_wise,
  row_wise, data_parallel), else ``[rows, dim]`` *by column*: element ``(r, c)`` is the
  accumulator of the column shard that holds column ``c``. Loading takes, for each target shard,
  the mean over its columns (computed in float64). So a resume with the same sharding is exact, a column
  shard loaded from a whole-row accumulator gets a copy of it, and whole rows loaded from column
  shards get the column-weighted mean of their accumulators. The weighted mean is exactly the
  accumulator an unsharded row-wise Adagrad would hold for the same gradients, because FBGEMM adds
  ``mean(grad_row ** 2)`` over the shard's columns each step.
* ``momentum1`` / ``momentum2``: point-wise ``[rows, dim]`` (Adagrad's sum; Adam's first and second
  moments), re-cut by DCP like the weight.
* ``step``: a 0-d tensor, saved from data-parallel torch optimizers only. FBGEMM's row-wise
  Adagrad has no step, and TorchRec does not expose FBGEMM Adam's ``iter``; a data-parallel table
  loaded from a checkpoint without ``step`` gets the checkpoint's global step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties

NAMESPACE = "embedding_optimizer"
ROWWISE_MOMENTUM = "rowwise_momentum1"
MOMENTUM1 = "momentum1"
MOMENTUM2 = "momentum2"
STEP = "step"

# The normalized states each EmbeddingOptimizerConfig.name keeps, in FBGEMM's state order.
NORMALIZED_STATES: dict[str, tuple[str, ...]] = {
    "sgd": (),
    "rowwise_adagrad": (ROWWISE_MOMENTUM,),
    "adagrad": (MOMENTUM1,),
    "adam": (MOMENTUM1, MOMENTUM2),
}
# The torch optimizers of data-parallel tables (EmbeddingOptimizerConfig.make_torch_optimizer):
# their per-parameter state names -> normalized names.
TORCH_STATE_NAMES: dict[str, dict[str, str]] = {
    "sgd": {},
    "rowwise_adagrad": {"sum": ROWWISE_MOMENTUM},
    "adagrad": {"sum": MOMENTUM1},
    "adam": {"exp_avg": MOMENTUM1, "exp_avg_sq": MOMENTUM2},
}

LayoutKind = Literal["replicated", "row_blocks", "column_blocks", "grid"]
Offsets = tuple[int, ...]


def state_key(weight_key: str, state: str) -> str:
    """The DCP key of one table's normalized optimizer state."""
    return f"{NAMESPACE}.{weight_key}.{state}"


def table_name(weight_key: str) -> str:
    """``'ebc.embedding_bags.t1.weight'`` -> ``'t1'`` (TorchRec names table parameters ``<table>.weight``)."""
    parts = weight_key.split(".")
    return parts[-2] if len(parts) >= 2 else weight_key


def accepted_shapes(state: str, rows: int, dim: int) -> tuple[tuple[int, ...], ...]:
    """The global shapes a checkpoint may hold for one normalized state of a ``rows x dim`` table."""
    if state == ROWWISE_MOMENTUM:
        return ((rows,), (rows, dim))
    if state == STEP:
        return ((),)
    return ((rows, dim),)


# ----------------------------------------------------------------- the rules, as pure functions
def rowwise_to_columns(accumulator: torch.Tensor, num_columns: int) -> torch.Tensor:
    """A row-wise accumulator ``[rows]`` spread over ``num_columns`` columns: ``[rows, num_columns]``."""
    return accumulator.reshape(-1, 1).expand(-1, num_columns).contiguous()


def columns_to_rowwise(by_column: torch.Tensor) -> torch.Tensor:
    """``[rows, cols]`` -> ``[rows]``: the mean over columns, in float64 so equal values come back exactly."""
    return by_column.to(torch.float64).mean(dim=1).to(by_column.dtype)


# ----------------------------------------------------------------- table placements
@dataclass(frozen=True)
class TablePlacement:
    """Where one embedding table's weight lives: its global shape and shards (None: data-parallel)."""

    key: str
    rows: int
    dim: int
    shards: tuple[ShardMetadata, ...] | None

    @classmethod
    def of(cls, key: str, weight: torch.Tensor) -> TablePlacement:
        if isinstance(weight, ShardedTensor):
            rows, dim = weight.size()
            return cls(key=key, rows=rows, dim=dim, shards=tuple(weight.metadata().shards_metadata))
        if weight.dim() != 2:
            raise ValueError(f"embedding table weight {key!r} has shape {tuple(weight.shape)}; expected [rows, dim].")
        return cls(key=key, rows=weight.shape[0], dim=weight.shape[1], shards=None)

    @property
    def kind(self) -> LayoutKind:
        if self.shards is None:
            return "replicated"
        if all(s.shard_sizes[1] == self.dim for s in self.shards):
            return "row_blocks"  # table_wise, row_wise, table_row_wise
        if all(s.shard_sizes[0] == self.rows for s in self.shards):
            return "column_blocks"  # column_wise, table_column_wise
        return "grid"

    def local_shards(self, rank: int) -> list[ShardMetadata]:
        return [s for s in self.shards or () if _rank_of(s) == rank]

    def check_supported(self) -> None:
        if self.kind == "grid":
            raise NotImplementedError(
                f"table {table_name(self.key)!r} ({self.key}) is sharded by rows and columns at once (grid "
                "sharding); its row-wise optimizer state cannot be checkpointed by lightning_recsys yet. Use "
                "table_wise, row_wise, column_wise, table_row_wise, table_column_wise or data_parallel."
            )

    def weight_shard_of_rowwise_state(self, state_offset: int) -> ShardMetadata:
        """The weight shard a native row-wise state shard belongs to (TorchRec's offsets, see module doc)."""
        if self.kind == "row_blocks":
            return next(s for s in self.shards or () if s.shard_offsets[0] == state_offset)
        by_column = sorted(self.shards or (), key=lambda s: s.shard_offsets[1])
        return by_column[state_offset // self.rows]

    def weight_shard_at(self, offsets: Sequence[int]) -> ShardMetadata:
        return next(s for s in self.shards or () if list(s.shard_offsets) == list(offsets))


def _rank_of(shard: ShardMetadata) -> int:
    assert shard.placement is not None
    return shard.placement.rank()


def _device_of(shard: ShardMetadata) -> torch.device:
    assert shard.placement is not None
    return shard.placement.device()


def _sharded_tensor(
    size: Sequence[int],
    metas: Sequence[ShardMetadata],
    local: Mapping[Offsets, torch.Tensor],
    dtype: torch.dtype,
    process_group: dist.ProcessGroup | None,
) -> ShardedTensor:
    """A ShardedTensor over ``metas`` whose local shards are ``local[offsets]``."""
    rank = dist.get_rank()
    shards = [Shard(local[tuple(m.shard_offsets)], m) for m in metas if _rank_of(m) == rank]
    properties = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False, pin_memory=False)
    metadata = ShardedTensorMetadata(shards_metadata=list(metas), size=torch.Size(size), tensor_properties=properties)
    # As TorchRec builds its optimizer-state ShardedTensors: init_from_local_shards would all-gather the metadata.
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, metadata, process_group=process_group)


def _row_block_metas(placement: TablePlacement) -> list[ShardMetadata]:
    """1-D shards over the rows of a table whose shards span all columns."""
    return [
        ShardMetadata(shard_offsets=[s.shard_offsets[0]], shard_sizes=[s.shard_sizes[0]], placement=s.placement)
        for s in placement.shards or ()
    ]


# ----------------------------------------------------------------- one rank's embedding optimizer state
@dataclass
class StateReads:
    """What ``dcp.load`` must read into (``targets``) and how to move it into the live state after."""

    targets: dict[str, torch.Tensor | ShardedTensor] = field(default_factory=dict)
    _apply: list[Callable[[], None]] = field(default_factory=list)

    def apply(self) -> None:
        with torch.no_grad():
            for fn in self._apply:
                fn()


@dataclass
class EmbeddingOptimizerState:
    """One rank's embedding optimizer state for every table, normalized (see the module doc).

    Args:
        optimizer_name: ``EmbeddingOptimizerConfig.name``.
        tables: every embedding table's placement, keyed by its weight key in the model state dict.
        fused_state: weight key -> this rank's native FBGEMM states, in FBGEMM's order (ShardedTensors
            whose local shards are the live state); tables without a local shard may be absent.
        data_parallel_optimizer: the torch optimizer of the data-parallel tables, if any.
        data_parallel_params: weight key -> parameter, for the data-parallel tables.
        process_group: the sharding group the tables' shards are placed on.
    """

    optimizer_name: str
    tables: dict[str, TablePlacement]
    fused_state: dict[str, list[tuple[str, ShardedTensor]]]
    data_parallel_optimizer: torch.optim.Optimizer | None
    data_parallel_params: dict[str, torch.nn.Parameter]
    process_group: dist.ProcessGroup | None

    def __post_init__(self) -> None:
        if self.optimizer_name not in NORMALIZED_STATES:
            raise ValueError(
                f"embedding optimizer {self.optimizer_name!r} has no checkpoint mapping; supported: {sorted(NORMALIZED_STATES)}."
            )
        expected = NORMALIZED_STATES[self.optimizer_name]
        for key, native in self.fused_state.items():
            if key not in self.tables:
                raise ValueError(
                    f"the fused optimizer has state for {key!r}, which is not a key of the model state dict "
                    f"(its tables: {sorted(self.tables)}). Pass the state dict of the module that was sharded "
                    "(ShardedModel.dmp.module), without extra prefixes."
                )
            if len(native) != len(expected):
                raise NotImplementedError(
                    f"FBGEMM keeps the states {[n for n, _ in native]} for table {table_name(key)!r} under "
                    f"optimizer {self.optimizer_name!r}; lightning_recsys checkpoints {list(expected)} for it. "
                    "Use an EmbeddingOptimizerConfig without extra FBGEMM options (counters, weight-decay modes)."
                )
            for _, value in native:
                if not isinstance(value, ShardedTensor):
                    raise NotImplementedError(
                        f"the fused optimizer state of table {table_name(key)!r} is a {type(value).__name__}, not a "
                        "ShardedTensor (TorchRec's DTensor output); only ShardedTensor state can be checkpointed."
                    )
        if ROWWISE_MOMENTUM in expected:
            for placement in self.tables.values():
                placement.check_supported()

    @property
    def states(self) -> tuple[str, ...]:
        return NORMALIZED_STATES[self.optimizer_name]

    # --------------------------------------------------------------------------- save
    def state_dict_for_save(self) -> dict[str, torch.Tensor | ShardedTensor]:
        """The normalized state for ``dcp.save``: ShardedTensors for model-parallel tables, tensors for the rest."""
        out: dict[str, torch.Tensor | ShardedTensor] = {}
        for key, placement in self.tables.items():
            if placement.shards is None:
                out.update(self._data_parallel_for_save(placement))
                continue
            native = dict(enumerate(value for _, value in self.fused_state.get(key, [])))
            for index, state in enumerate(self.states):
                out[state_key(key, state)] = self._model_parallel_for_save(placement, state, native.get(index))
        return out

    def _model_parallel_for_save(self, placement: TablePlacement, state: str, native: ShardedTensor | None) -> ShardedTensor:
        pieces: dict[Offsets, torch.Tensor] = {}  # weight shard offsets -> this rank's native state
        for shard in native.local_shards() if native is not None else []:
            if state == ROWWISE_MOMENTUM:
                weight_shard = placement.weight_shard_of_rowwise_state(shard.metadata.shard_offsets[0])
            else:
                weight_shard = placement.weight_shard_at(shard.metadata.shard_offsets)
            pieces[tuple(weight_shard.shard_offsets)] = shard.tensor.detach()
        dtype = next(iter(pieces.values())).dtype if pieces else torch.float32
        shards = list(placement.shards or ())
        if state == ROWWISE_MOMENTUM and placement.kind == "row_blocks":
            local = {(offsets[0],): t.contiguous() for offsets, t in pieces.items()}
            return _sharded_tensor([placement.rows], _row_block_metas(placement), local, dtype, self.process_group)
        if state == ROWWISE_MOMENTUM:  # column blocks: by column, see the module doc
            sizes = {tuple(s.shard_offsets): s.shard_sizes[1] for s in shards}
            local = {offsets: rowwise_to_columns(t, sizes[offsets]) for offsets, t in pieces.items()}
            return _sharded_tensor([placement.rows, placement.dim], shards, local, dtype, self.process_group)
        local = {offsets: t.contiguous() for offsets, t in pieces.items()}
        return _sharded_tensor([placement.rows, placement.dim], shards, local, dtype, self.process_group)

    def _data_parallel_for_save(self, placement: TablePlacement) -> dict[str, torch.Tensor]:
        param = self.data_parallel_params.get(placement.key)
        if param is None or self.data_parallel_optimizer is None:
            if self.states:
                raise ValueError(
                    f"table {table_name(placement.key)!r} is data-parallel, but no torch optimizer state was given "
                    "for it; pass data_parallel_table_optimizer (EmbeddingOptimizerConfig.make_torch_optimizer)."
                )
            return {}
        torch_state = self.data_parallel_optimizer.state.get(param, {})
        out: dict[str, torch.Tensor] = {}
        for native, state in TORCH_STATE_NAMES[self.optimizer_name].items():
            value = torch_state.get(native)
            if value is None:  # torch optimizers that initialize lazily (Adam) before their first step
                value = torch.zeros(placement.rows, placement.dim) if state != ROWWISE_MOMENTUM else torch.zeros(placement.rows)
            out[state_key(placement.key, state)] = value.detach().reshape(placement.rows) if state == ROWWISE_MOMENTUM else value.detach()
        step = torch_state.get("step")
        if step is not None:
            out[state_key(placement.key, STEP)] = torch.as_tensor(step, dtype=torch.float32).detach().reshape(())
        return out

    # --------------------------------------------------------------------------- load
    def plan_reads(
        self,
        saved: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        *,
        default_step: float,
    ) -> StateReads:
        """Read targets for ``dcp.load`` given the checkpoint's keys (``saved``: key -> global shape, dtype).

        Call after validation, with the entries to load: a table whose states are not all in ``saved``
        (skipped with ``strict=False``) keeps its current state.
        """
        reads = StateReads()
        for key, placement in self.tables.items():
            if any(state_key(key, state) not in saved for state in self.states):
                continue
            if placement.shards is None:
                self._plan_data_parallel(reads, placement, saved, default_step)
                continue
            native = dict(enumerate(value for _, value in self.fused_state.get(key, [])))
            for index, state in enumerate(self.states):
                shape, dtype = saved[state_key(key, state)]
                self._plan_model_parallel(reads, placement, state, shape, dtype, native.get(index))
        return reads

    def _plan_model_parallel(
        self,
        reads: StateReads,
        placement: TablePlacement,
        state: str,
        saved_shape: tuple[int, ...],
        saved_dtype: torch.dtype,
        native: ShardedTensor | None,
    ) -> None:
        key = state_key(placement.key, state)
        rank = dist.get_rank()
        local_weight_shards = placement.local_shards(rank)
        # (live native shard tensor, the weight shard it belongs to)
        targets: list[tuple[torch.Tensor, ShardMetadata]] = []
        for shard in native.local_shards() if native is not None else []:
            offsets = shard.metadata.shard_offsets
            weight_shard = (
                placement.weight_shard_of_rowwise_state(offsets[0]) if state == ROWWISE_MOMENTUM else placement.weight_shard_at(offsets)
            )
            targets.append((shard.tensor, weight_shard))

        def buffer(meta: ShardMetadata, sizes: Sequence[int]) -> torch.Tensor:
            return torch.empty(list(sizes), dtype=saved_dtype, device=_device_of(meta))

        if state == ROWWISE_MOMENTUM and len(saved_shape) == 1:  # saved as whole-row accumulators
            if placement.kind == "row_blocks":
                metas = _row_block_metas(placement)
                local = {(m.shard_offsets[0],): buffer(m, m.shard_sizes) for m in metas if _rank_of(m) == rank}
                reads.targets[key] = _sharded_tensor([placement.rows], metas, local, saved_dtype, self.process_group)

                def apply_rows() -> None:
                    for live, weight_shard in targets:
                        live.copy_(local[(weight_shard.shard_offsets[0],)])

                reads._apply.append(apply_rows)
            elif local_weight_shards:  # column blocks: each needs every row; shards overlap, so read it whole
                whole = buffer(local_weight_shards[0], [placement.rows])
                reads.targets[key] = whole

                def apply_copies() -> None:
                    for live, weight_shard in targets:
                        row0, rows = weight_shard.shard_offsets[0], weight_shard.shard_sizes[0]
                        live.copy_(whole[row0 : row0 + rows])

                reads._apply.append(apply_copies)
            return

        # Saved [rows, dim] (point-wise state, or row-wise state by column): read what mirrors the weight.
        shards = list(placement.shards or ())
        local = {tuple(m.shard_offsets): buffer(m, m.shard_sizes) for m in shards if _rank_of(m) == rank}
        reads.targets[key] = _sharded_tensor([placement.rows, placement.dim], shards, local, saved_dtype, self.process_group)
        rowwise = state == ROWWISE_MOMENTUM

        def apply_mirrored() -> None:
            for live, weight_shard in targets:
                piece = local[tuple(weight_shard.shard_offsets)]
                live.copy_(columns_to_rowwise(piece) if rowwise else piece)

        reads._apply.append(apply_mirrored)

    def _plan_data_parallel(
        self,
        reads: StateReads,
        placement: TablePlacement,
        saved: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        default_step: float,
    ) -> None:
        if not self.states:
            return
        param = self.data_parallel_params.get(placement.key)
        optimizer = self.data_parallel_optimizer
        if param is None or optimizer is None:
            raise ValueError(
                f"table {table_name(placement.key)!r} is data-parallel, but no torch optimizer was given to load its "
                "state into; pass data_parallel_table_optimizer (EmbeddingOptimizerConfig.make_torch_optimizer)."
            )
        buffers: dict[str, torch.Tensor] = {}
        for state in self.states:
            shape, dtype = saved[state_key(placement.key, state)]
            buffers[state] = torch.empty(list(shape), dtype=dtype, device=param.device)
            reads.targets[state_key(placement.key, state)] = buffers[state]
        step_key = state_key(placement.key, STEP)
        if step_key in saved:
            buffers[STEP] = torch.empty((), dtype=saved[step_key][1])
            reads.targets[step_key] = buffers[STEP]
        else:
            buffers[STEP] = torch.tensor(float(default_step))
        native_names = {state: native for native, state in TORCH_STATE_NAMES[self.optimizer_name].items()}

        def apply() -> None:
            torch_state: dict[str, Any] = optimizer.state[param]
            for state in self.states:
                value = buffers[state]
                if state == ROWWISE_MOMENTUM:
                    value = (value if value.dim() == 1 else columns_to_rowwise(value)).reshape(placement.rows, 1)
                _assign(torch_state, native_names[state], value, like=param)
            _assign(torch_state, "step", buffers[STEP].to(torch.float32), like=None)

        reads._apply.append(apply)


def _assign(torch_state: dict[str, Any], name: str, value: torch.Tensor, *, like: torch.Tensor | None) -> None:
    """Copy into the optimizer's existing tensor (keeping references valid), or create it."""
    current = torch_state.get(name)
    if isinstance(current, torch.Tensor) and current.shape == value.shape:
        current.copy_(value)
    elif like is not None:
        torch_state[name] = value.to(device=like.device, dtype=like.dtype).clone()
    else:
        torch_state[name] = value.clone()
