"""Sharding the LightningModule at setup: plan it, build the final codecs from the plan, wrap it in DMP.

A module that an earlier Trainer's strategy sharded is reused instead (TorchRec replaced its tables
in place, so it cannot be planned again), if the settings that decide the sharding are the same.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Protocol, TypeVar

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_recsys._upstream_logging import root_logger_left_unconfigured
from lightning_recsys.parallel import EmbeddingOptimizerConfig, ParallelTopology, ShardedModel, shard_model
from lightning_recsys.parallel.comms import EffectiveQComms, QCommsConfig
from lightning_recsys.parallel.input import InputValidator, feature_tables, module_length_rules
from lightning_recsys.parallel.sharding import ROW_SHARDED_TYPES, ShardedRuntime
from lightning_recsys.planner import PlanningConfig, PlanReport, model_tables, plan_rows, summarize_plan
from lightning_recsys.planner.pipeline import PlanningPipeline
from lightning_recsys.strategies.planning import PlanningSettings, planning_sharders

_RECORD = "_lightning_recsys_sharding"  # in the module's __dict__: not a submodule, not in state_dict
_T = TypeVar("_T")


class ShardingStrategy(PlanningSettings, Protocol):
    """What sharding reads of the strategy (``TwoDRecStrategy``): its settings, world layout, device and rank."""

    @property
    def topology(self) -> ParallelTopology: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def global_rank(self) -> int: ...

    def broadcast(self, obj: _T, src: int = 0) -> _T: ...


@dataclass(frozen=True)
class ShardingSettings:
    """Everything that decides how the tables are sharded and updated; compared when a module is reused."""

    topology: tuple[int, int, str, int]  # world size, sharding group size, layout, ranks per node
    device: str
    embedding_optimizer: EmbeddingOptimizerConfig
    qcomms: QCommsConfig
    planning: PlanningConfig

    @classmethod
    def of(cls, strategy: ShardingStrategy) -> ShardingSettings:
        topology = strategy.topology
        return cls(
            topology=(topology.world_size, topology.sharding_group_size, topology.layout, topology.node_size),
            device=strategy.root_device.type,
            # Whether the tables' LR follows a scheduler is decided per step, not by the sharding.
            embedding_optimizer=dataclasses.replace(strategy.embedding_optimizer_config, lr_follows_scheduler=False),
            qcomms=strategy.qcomms_config,
            planning=strategy.planning,
        )

    def differences(self, earlier: ShardingSettings) -> list[str]:
        return [
            f"{f.name}: {getattr(earlier, f.name)!r} then, {getattr(self, f.name)!r} now"
            for f in dataclasses.fields(self)
            if getattr(earlier, f.name) != getattr(self, f.name)
        ]


@dataclass
class ShardedSetup:
    """A sharded module and what its sharding decided; left on the module for a later Trainer to reuse."""

    sharded: ShardedModel
    settings: ShardingSettings
    input_validator: InputValidator
    equal_batch_sizes_required: bool  # row-wise pooling reduce-scatters, which needs equal batches
    effective_qcomms: EffectiveQComms  # with the plan's block size and any fallback it forced
    plan_report: Optional[PlanReport]  # rank 0
    runtime: Optional[ShardedRuntime] = None  # its accounting and row-tracking hooks are on the shared modules


def shard_or_reuse(strategy: ShardingStrategy, module: LightningModule) -> ShardedSetup:
    """The module's sharded setup: made now, or the one an earlier Trainer's strategy left on it."""
    settings = ShardingSettings.of(strategy)
    previous: Optional[ShardedSetup] = module.__dict__.get(_RECORD)
    if previous is None:
        setup = _shard(strategy, module, settings)
        module.__dict__[_RECORD] = setup
        return setup
    differing = settings.differences(previous.settings)
    if differing:
        raise ValueError(
            "TwoDRecStrategy: this module's tables were already sharded by an earlier Trainer's strategy with other "
            f"settings ({'; '.join(differing)}). TorchRec replaces the tables in place, so they cannot be re-planned. "
            "Use the same strategy settings and world, or build a fresh model and load a checkpoint into it "
            "(Trainer(...).test(fresh_model, ckpt_path=...))."
        )
    if previous.runtime is not None:
        previous.runtime.close()  # the earlier strategy's accounting and row-tracking hooks
        previous.runtime = None
    return previous


def _shard(strategy: ShardingStrategy, module: LightningModule, settings: ShardingSettings) -> ShardedSetup:
    validator = InputValidator(feature_tables(module), module_length_rules(module))  # also refuses tables without features
    topology: ParallelTopology = strategy.topology
    device = strategy.root_device
    planner_sharders, _ = planning_sharders(strategy, compute_device=device.type, topology=topology, device=device)
    pipeline = PlanningPipeline(
        strategy.planning, sharders=planner_sharders, topology=topology, compute_device=device.type,
        rank=strategy.global_rank, broadcast=strategy.broadcast,
        final_sharders=lambda plan: planning_sharders(strategy, compute_device=device.type, topology=topology, plan=plan, device=device)[0],
    )
    datamodule = getattr(module.trainer, "datamodule", None) if module._trainer is not None else None
    with root_logger_left_unconfigured():  # TorchRec's plan check calls logging.warning: it would configure the root logger
        planned = pipeline.run(module, datamodule, tables=model_tables(module))  # the Trainer has set the DataModule up
    sharders, codecs = planning_sharders(strategy, compute_device=device.type, topology=topology, plan=planned.plan, device=device)
    if planned.report is not None:
        report = planned.report.to_table()  # has its own header
    else:
        report = f"Sharding plan (group-local ranks, {strategy.planning.planner} planner):\n{summarize_plan(planned.plan)}"
    rank_zero_info(f"TwoDRecStrategy: {topology.describe()}\n{report}\nQComms (effective precisions):\n{codecs.effective.describe()}")
    if codecs.effective.fallbacks:
        rank_zero_warn("QComms: " + "; ".join(codecs.effective.fallbacks) + ".")
    with root_logger_left_unconfigured():  # FBGEMM's fused-table constructor calls logging.info (SplitTableBatchedEmbeddingBagsCodegen.log)
        sharded = shard_model(
            module, topology=topology, device=device, sharders=sharders, plan=planned.plan,
            dense_grads_precision=codecs.effective.dense_grads,
        )
    if not topology.is_1d and not sharded.model_parallel_tables:
        rank_zero_info(
            "TwoDRecStrategy: every table is data_parallel, so the replica sync has nothing to sync and is skipped "
            "(DDP keeps data-parallel tables equal on every rank); replica_sync settings have no effect."
        )
    if sharded.dense_all_reduce_staged:
        rank_zero_info(
            "TwoDRecStrategy: the dense gradients' all-reduce runs in two stages, inside each node's group and then "
            "across nodes (gloo's flat ring would wait on the network at each of its 2 x (world - 1) steps)."
        )
    return ShardedSetup(
        sharded=sharded,
        settings=settings,
        input_validator=validator,
        equal_batch_sizes_required=any(row["sharding_type"] in ROW_SHARDED_TYPES for row in plan_rows(planned.plan)),
        effective_qcomms=codecs.effective,
        plan_report=planned.report,
    )

