"""TwoDRecStrategy: TorchRec model parallelism for the embedding tables, data parallelism for the rest."""

from __future__ import annotations

import atexit
import gc
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, TypeVar, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.nn import Module
from torch.optim import Optimizer
from torchrec.distributed.types import ShardingPlan
from typing_extensions import override

from lightning_recsys._registration import STRATEGY_NAME, register
from lightning_recsys.checkpoint import ShardedState
from lightning_recsys.parallel import (
    EmbeddingOptimizerConfig,
    ParallelTopology,
    ShardedModel,
    make_sharders,
    shard_model,
)
from lightning_recsys.parallel.comm_accounting import CommAccountant, comm_purpose
from lightning_recsys.parallel.embedding_lr import EmbeddingLearningRate
from lightning_recsys.parallel.input_guard import (
    VALIDATE_INPUTS,
    CoordinatedBatches,
    InputValidator,
    ValidateInputs,
    feature_tables,
    report_lost_ranks,
)
from lightning_recsys.parallel.input_pipeline import PIPELINE_MODES, PipelineMode, SparseDistPipeline
from lightning_recsys.parallel.qcomms import EffectiveQComms, QCommsCodecs, QCommsConfig, resolve_qcomms
from lightning_recsys.parallel.replica_sync import SyncStats
from lightning_recsys.parallel.replica_sync_config import ReplicaSyncConfig
from lightning_recsys.parallel.runtime import ShardedRuntime
from lightning_recsys.parallel.sharders import ROW_SHARDED_TYPES, supported_sharding_types, validate_sharding_types
from lightning_recsys.parallel.topology import LAYOUTS, Layout
from lightning_recsys.parallel.upstream_warnings import silence_known_upstream_warnings
from lightning_recsys.planner import (
    PlanReport,
    TableConstraints,
    TableStats,
    plan_rows,
    summarize_plan,
)
from lightning_recsys.planner.pipeline import PlanningPipeline
from lightning_recsys.strategies.checkpoint_io import DCPCheckpointIO
from lightning_recsys.strategies.planning import planning_config

log = logging.getLogger(__name__)
PlannerName = Literal["torchrec", "balanced"]

class TwoDRecStrategy(ParallelStrategy):
    """Shard a LightningModule's TorchRec embedding tables across ranks; keep dense layers data-parallel.

    The strategy finds every ``EmbeddingBagCollection``/``EmbeddingCollection`` in the module, plans
    it with TorchRec's planner, and wraps the module in ``DistributedModelParallel``: embedding
    lookups go through TorchRec's all-to-all, dense parameters are synced by DDP over all ranks.

    2D parallelism: the world is split into sharding groups of ``sharding_group_size`` ranks (by
    default one node each). Tables are sharded inside a group, so the all-to-all stays on the
    node's links; every group holds a full replica, and replicas are averaged over the replica
    group (an all-reduce across nodes) every ``replica_sync.every_n_steps`` steps, and before
    validation, test, predict, checkpoint saves and the end of training. By default only the rows
    looked up since the last sync are averaged (``ReplicaSyncConfig(rows="touched")``).

    Optimizers: model-parallel tables are updated inside backward by FBGEMM's fused optimizer
    (``embedding_optimizer``); data-parallel tables get the same rule as a torch optimizer, stepped
    with the dense optimizers. What ``configure_optimizers`` returns is used for the dense
    parameters only (embedding parameters are removed from it), so LR schedulers and gradient
    clipping keep working on them.

    Args:
        embedding_optimizer: optimizer of the embedding tables (default: row-wise Adagrad, lr 0.05).
        sharding_types: sharding types the planner may use for every table; default: all that run on
            the device (data_parallel, table_wise, row_wise, column_wise, table_row_wise,
            table_column_wise).
        table_constraints: per-table planner constraints, keyed by table name.
        process_group_timeout: seconds a collective may wait before the job fails (default 1800,
            which leaves room for planning large models).
        process_group_backend: ``gloo`` or ``nccl``; default: nccl on CUDA, gloo on CPU.
        sharding_group_size: ranks the tables are sharded over; default: the devices per node.
            Equal to the world size means 1D (no replicas).
        layout: ``all_to_all_optimized`` (default: contiguous, node-local sharding groups; the
            replica all-reduce crosses nodes) or ``all_reduce_optimized`` (strided groups; the
            all-to-all crosses nodes and replicas sit inside a node).
        replica_sync: the 2D replica sync, a ``ReplicaSyncConfig``: which rows (default the rows
            touched since the last sync), how often (default every step), and whether the fused
            optimizer state is averaged too (default True).
        qcomms: precision of the embedding collectives: a preset (``"fp32"``, ``"bf16"``,
            ``"fp16"``, ``"fp8"``, ``"int8"``) or a ``QCommsConfig``; default fp32 (off).
        validate_inputs: check every batch's sparse ids, keys, lengths and weights against the
            tables before the step: ``"error"`` (default) stops every rank with the feature,
            table, id and example; ``"warn"`` logs out-of-range ids and goes on (FBGEMM then
            clamps the id to row 0) but still stops on problems no clamp can fix (duplicate or
            missing keys, bad weights); ``"off"``.
        check_finite: stop every rank with the step number when the loss or a looked-up embedding
            is not finite (also on with ``Trainer(detect_anomaly=True)``). Costs one small
            all-reduce per step.
        planner: ``"torchrec"`` (TorchRec's planner) or ``"balanced"`` (``BalancedPlanner``: balances
            storage, lookups and all-to-all bytes per rank, not just memory).
        planner_stats: per-table traffic statistics for the balanced planner, keyed by table name.
        profile_batches: with the balanced planner, measure the statistics on this many training
            batches of the DataModule first (rank 0).
        hash_partitions: tables hashed into P partitions, keyed by table name; the balanced planner
            shards them row-wise on partition boundaries, P / sharding_group_size per rank.
        reshape_tables: apply the reshape advice (halve the dim, double the rows, where that cuts
            the all-to-all bytes) to the model's tables before sharding. Opt-in; changes the model.
        embedding_lr_follows_scheduler: the tables' learning rate follows the first LR scheduler:
            ``embedding_optimizer.lr`` times that scheduler's factor (its optimizer's current lr over
            its ``initial_lr``), applied before every training step. Off by default: schedulers then
            move only the dense optimizers.
    """

    strategy_name = STRATEGY_NAME

    def __init__(
        self,
        *,
        embedding_optimizer: Optional[EmbeddingOptimizerConfig] = None,
        sharding_types: Optional[list[str]] = None,
        table_constraints: Optional[dict[str, TableConstraints]] = None,
        process_group_timeout: float = 1800.0,
        process_group_backend: Optional[str] = None,
        sharding_group_size: Optional[int] = None,
        layout: Layout = "all_to_all_optimized",
        replica_sync: Optional[ReplicaSyncConfig] = None,
        qcomms: Union[str, QCommsConfig, None] = None,
        validate_inputs: ValidateInputs = "error",
        check_finite: bool = False,
        planner: PlannerName = "torchrec",
        planner_stats: Optional[dict[str, TableStats]] = None,
        profile_batches: int = 0,
        hash_partitions: Optional[dict[str, int]] = None,
        reshape_tables: bool = False,
        embedding_lr_follows_scheduler: bool = False,
        pipeline: PipelineMode = "sparse_dist",
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if embedding_optimizer is not None and not isinstance(embedding_optimizer, EmbeddingOptimizerConfig):
            raise TypeError(
                f"embedding_optimizer={embedding_optimizer!r} must be an EmbeddingOptimizerConfig, "
                "e.g. EmbeddingOptimizerConfig(name='sgd', lr=0.1)."
            )
        if sharding_types is not None and not sharding_types:
            raise ValueError("sharding_types=[] allows no sharding type; pass None to allow all.")
        for sharding_type in sharding_types or []:
            validate_sharding_types([sharding_type], "cuda", "sharding_types")
        if not process_group_timeout > 0:
            raise ValueError(f"process_group_timeout={process_group_timeout} must be > 0 seconds.")
        if process_group_backend not in (None, "gloo", "nccl"):
            raise ValueError(f"process_group_backend={process_group_backend!r} must be 'gloo', 'nccl' or None.")
        if sharding_group_size is not None and (isinstance(sharding_group_size, bool) or sharding_group_size < 1):
            raise ValueError(f"sharding_group_size={sharding_group_size!r} must be an integer >= 1, or None for the devices per node.")
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r} is not one of {list(LAYOUTS)}.")
        if replica_sync is not None and not isinstance(replica_sync, ReplicaSyncConfig):
            raise TypeError(
                f"replica_sync={replica_sync!r} must be a ReplicaSyncConfig, e.g. ReplicaSyncConfig(every_n_steps=4)."
            )
        if validate_inputs not in VALIDATE_INPUTS:
            raise ValueError(f"validate_inputs={validate_inputs!r} is not one of {list(VALIDATE_INPUTS)}.")
        if planner not in ("torchrec", "balanced"):
            raise ValueError(f"planner={planner!r} is not one of ['torchrec', 'balanced'].")
        if isinstance(profile_batches, bool) or not isinstance(profile_batches, int) or profile_batches < 0:
            raise ValueError(f"profile_batches={profile_batches!r} must be an integer >= 0.")
        balanced_only = {"planner_stats": planner_stats, "profile_batches": profile_batches, "hash_partitions": hash_partitions}
        for name, value in balanced_only.items():
            if value and planner != "balanced":
                raise ValueError(f"{name}={value!r} needs planner='balanced' (TorchRec's planner does not use it).")
        if hash_partitions and sharding_types is not None and "row_wise" not in sharding_types:
            raise ValueError(
                f"hash_partitions={hash_partitions!r} shards those tables row-wise, but sharding_types={sharding_types!r} "
                "does not allow 'row_wise'."
            )
        # --- input pipeline (issue 17) ---
        if pipeline not in PIPELINE_MODES:
            raise ValueError(f"pipeline={pipeline!r} is not one of {list(PIPELINE_MODES)}.")
        self._pipeline_mode: PipelineMode = pipeline
        self._input_pipeline: Optional[SparseDistPipeline] = None
        # --- end input pipeline ---
        self.embedding_optimizer_config = embedding_optimizer or EmbeddingOptimizerConfig()
        self._validate_inputs: ValidateInputs = validate_inputs
        self._planner: PlannerName = planner
        self._planner_stats = dict(planner_stats) if planner_stats else None
        self._profile_batches = profile_batches
        self._hash_partitions = dict(hash_partitions) if hash_partitions else None
        self._reshape_tables = bool(reshape_tables)
        self.plan_report: Optional[PlanReport] = None  # rank 0, after setup
        self._check_finite = bool(check_finite)
        self._coordination_group: Optional[dist.ProcessGroup] = None
        self._input_validator: Optional[InputValidator] = None
        self._equal_batch_sizes_required = False
        self._embedding_lr_follows_scheduler = bool(embedding_lr_follows_scheduler)
        self.qcomms_config = QCommsConfig.parse(qcomms)
        self._effective_qcomms = resolve_qcomms(self.qcomms_config)
        self._sharding_group_size = sharding_group_size
        self._layout: Layout = layout
        self.replica_sync_config = replica_sync or ReplicaSyncConfig()
        self._topology: Optional[ParallelTopology] = None
        self._runtime: Optional[ShardedRuntime] = None
        self._sharding_types = list(sharding_types) if sharding_types is not None else None
        self._table_constraints = dict(table_constraints or {})
        self._timeout = timedelta(seconds=process_group_timeout)
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self._sharded: Optional[ShardedModel] = None

    # ----------------------------------------------------------------- ranks and devices
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def is_distributed(self) -> bool:
        # Lightning only honours self.log(sync_dist=True) and injects distributed samplers for
        # strategies it knows, or ones that say so through this property.
        return True

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    def sharded_model(self) -> ShardedModel:
        """The sharded model, its plan and its embedding optimizer; available after setup."""
        return _available(self._sharded, "sharded_model", "set up the model")

    @property
    def topology(self) -> ParallelTopology:
        """The 2D rank layout (sharding and replica groups); available once the environment is set up."""
        return _available(self._topology, "topology", "set up the environment")

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``("replicate", "shard")`` device mesh; also readable as ``LightningModule.device_mesh``."""
        return self.topology.device_mesh(self.root_device.type)

    @property
    def effective_qcomms(self) -> EffectiveQComms:
        """The precision each embedding collective really uses, per direction, and any fallbacks."""
        return self._effective_qcomms

    @property
    def comm_accounting(self) -> CommAccountant:
        """Bytes per collective in the last training step and in total; available after setup."""
        return self.runtime.comm

    @property
    def runtime(self) -> ShardedRuntime:
        """The sharded model's run-time state (table optimizers, replica sync, accounting); after setup."""
        return _available(self._runtime, "runtime", "set up the model")

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        silence_known_upstream_warnings()  # before planning and sharding, where most of them come from
        super().setup_environment()
        self.set_world_ranks()
        topology = self._make_topology()
        if topology != self._topology:  # a later fit/validate/test keeps the mesh (and groups) it already has
            self._topology = topology
        self._validate_backend()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        if not _distributed_is_initialized():  # else the user (or a previous Trainer) owns the process group
            device_id = self.root_device if self.root_device.type != "cpu" else None
            _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout, device_id=device_id)
            # Workaround: torch 2.13 aborts at interpreter exit ("terminate called without an active
            # exception", SIGABRT) when the default process group is never destroyed.
            atexit.register(_destroy_process_group_at_exit)
        # A CPU group for the per-step batch handshake and failure diagnosis (gloo: monitored_barrier).
        if self._coordination_group is None:
            self._coordination_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=self._timeout)
        for warning in self._topology.layout_warnings():
            rank_zero_warn(warning)
        mesh = self.device_mesh  # collective: every rank builds it here
        if self.lightning_module is not None:
            self.lightning_module._device_mesh = mesh

    def _make_topology(self) -> ParallelTopology:
        group_size = self._sharding_group_size or self.num_processes
        world = self.num_nodes * self.num_processes
        if world % group_size or group_size > world:
            valid = [d for d in range(1, world + 1) if world % d == 0]
            raise ValueError(
                f"TwoDRecStrategy(sharding_group_size={group_size}) must divide the world size {world} "
                f"(devices={self.num_processes} x num_nodes={self.num_nodes}); valid sizes are {valid}."
            )
        return ParallelTopology(
            world_size=world, sharding_group_size=group_size, layout=self._layout, ranks_per_node=self.num_processes
        )

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _validate_backend(self) -> None:
        device_type = self.root_device.type
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"TwoDRecStrategy runs on accelerator 'cpu' or 'cuda', not {device_type!r}.")
        if device_type == "cpu" and self._process_group_backend == "nccl":
            raise ValueError("process_group_backend='nccl' needs CUDA devices; use 'gloo' (or None) with accelerator='cpu'.")
        self.embedding_optimizer_config.check_device(device_type, self._sharding_types)
        two_d = not self.topology.is_1d
        if self._sharding_types is not None:
            validate_sharding_types(self._sharding_types, device_type, "sharding_types", two_d=two_d)
        for table, constraints in self._table_constraints.items():
            argument = f"table_constraints[{table!r}].sharding_types"
            validate_sharding_types(constraints.sharding_types or [], device_type, argument, two_d=two_d)

    # ----------------------------------------------------------------- model and optimizers
    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._validate_trainer(trainer)
        sharded = self._shard(self.lightning_module)
        self.model = sharded.dmp
        self.runtime.start()
        scaler = getattr(self.precision_plugin, "scaler", None)  # fp16 loss scaling (16-mixed)
        self.runtime.install_output_hooks(
            check_finite=self._check_finite or getattr(trainer, "_detect_anomaly", False),
            grad_scale=scaler._get_scale_async if scaler is not None else None,
        )
        assert isinstance(self.checkpoint_io, DCPCheckpointIO)
        self.checkpoint_io.connect(self)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _validate_trainer(self, trainer: Trainer) -> None:
        precision = self.precision_plugin
        if type(precision) is not Precision and not isinstance(precision, MixedPrecision):
            raise ValueError(
                f"TwoDRecStrategy supports precision '32-true', 'bf16-mixed' and (CUDA) '16-mixed'; got "
                f"{type(precision).__name__} (precision={getattr(precision, 'precision', '?')!r}). The tables stay in "
                "their own dtype; embedding communication precision is set separately (qcomms)."
            )
        if getattr(trainer, "gradient_clip_val", None):
            rank_zero_warn(
                f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) clips the dense parameters only: FBGEMM "
                "updates the model-parallel embedding tables inside backward, before clipping could run.",
                category=UserWarning,
            )
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is not supported: the fused "
                "embedding optimizer updates the tables in every backward pass. Use accumulate_grad_batches=1 "
                "and a larger batch instead."
            )
        if not isinstance(self.checkpoint_io, DCPCheckpointIO):
            raise ValueError(
                f"TwoDRecStrategy needs checkpoint_io=DCPCheckpointIO (the default); got "
                f"{type(self.checkpoint_io).__name__}, which would save only rank 0's shards."
            )

    def _shard(self, module: LightningModule) -> ShardedModel:
        if self._sharded is not None and self._sharded.dmp.module is module:
            return self._sharded  # a later fit/validate/test call on the same, already sharded module
        topology = self.topology
        settings = self._sharding_settings()
        previous: Optional[_ShardingRecord] = module.__dict__.get(_SHARDING_RECORD)
        if previous is not None:  # sharded by an earlier Trainer's strategy: reuse it if it fits
            _check_reusable(previous.settings, settings)
            sharded = previous.sharded
            self._input_validator = previous.input_validator
            self._equal_batch_sizes_required = previous.equal_batch_sizes_required
            if previous.runtime is not None:
                previous.runtime.close()  # the earlier strategy's accounting and row-tracking hooks
        else:
            sharded = self._shard_fresh(module, topology)
        record = _ShardingRecord(sharded, settings, self._input_validator, self._equal_batch_sizes_required)  # type: ignore[arg-type]
        module.__dict__[_SHARDING_RECORD] = record
        if self._runtime is not None:
            self._runtime.close()
        self._runtime = record.runtime = ShardedRuntime(
            sharded,
            topology,
            embedding_optimizer=self.embedding_optimizer_config,
            replica_sync=self.replica_sync_config,
            coordination_group=self._coordination_group,
        )
        self._sharded = sharded
        return sharded

    def _shard_fresh(self, module: LightningModule, topology: ParallelTopology) -> ShardedModel:
        self._input_validator = InputValidator(feature_tables(module))  # also refuses tables without features
        allowed = self._sharding_types
        if allowed is None and not topology.is_1d:
            allowed = supported_sharding_types(self.root_device.type, two_d=True)
        # From the request, not from an earlier plan's fallbacks; device= picks FBGEMM's kernels on CUDA.
        codecs = QCommsCodecs.build(resolve_qcomms(self.qcomms_config), device=self.root_device)
        sharders = make_sharders(
            self.embedding_optimizer_config.fused_params(), allowed, qcomm_codecs_registry=codecs.registry
        )
        plan = self._plan(module, sharders, topology)
        codecs.fix_block_size(plan)
        self._effective_qcomms = codecs.effective  # with the block size and any block-size fallback
        # Row-wise pooling reduce-scatters, which needs the same batch size on every rank.
        self._equal_batch_sizes_required = any(
            row["sharding_type"] in ROW_SHARDED_TYPES for row in plan_rows(plan)
        )
        report = self.plan_report.to_table() if self.plan_report is not None else summarize_plan(plan)
        rank_zero_info(
            f"TwoDRecStrategy: {topology.describe()}\nSharding plan (group-local ranks, {self._planner} planner):\n"
            f"{report}\nQComms (effective precisions):\n{self._effective_qcomms.describe()}"
        )
        if self._effective_qcomms.fallbacks:
            rank_zero_warn("QComms: " + "; ".join(self._effective_qcomms.fallbacks) + ".")
        return shard_model(
            module,
            topology=topology,
            device=self.root_device,
            sharders=sharders,
            plan=plan,
            dense_grads_precision=self._effective_qcomms.dense_grads,
        )

    def _sharding_settings(self) -> dict[str, Any]:
        """Everything that decides how the tables are sharded and updated (compared when a module is reused)."""
        topology = self.topology
        return {
            "topology": (topology.world_size, topology.sharding_group_size, topology.layout, topology.node_size),
            "device": self.root_device.type,
            "embedding_optimizer": self.embedding_optimizer_config,
            "qcomms": self.qcomms_config,
            "sharding_types": self._sharding_types,
            "table_constraints": self._table_constraints,
            "planner": self._planner,
            "planner_stats": self._planner_stats,
            "hash_partitions": self._hash_partitions,
            "reshape_tables": self._reshape_tables,
        }


    def _plan(self, module: LightningModule, sharders: list[Any], topology: ParallelTopology) -> ShardingPlan:
        """The planning pipeline: profile (optional), reshape (optional), plan on rank 0 for every rank, report."""
        pipeline = PlanningPipeline(
            planning_config(self), sharders=sharders, topology=topology, compute_device=self.root_device.type,
            rank=self.global_rank, broadcast=self.broadcast,
        )
        datamodule = getattr(module.trainer, "datamodule", None) if module._trainer is not None else None
        planned = pipeline.run(module, datamodule)  # the Trainer has set the DataModule up
        self.plan_report = planned.report  # rank 0; before shard_model, as DMP replaces the embedding modules
        return planned.plan

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        removed = self.runtime.strip_embedding_params([_unwrap_optimizer(o) for o in self.optimizers])
        if removed:
            log.debug("TwoDRecStrategy: removed %d embedding parameters from the dense optimizers", removed)
        self.runtime.make_table_optimizers()
        if self._embedding_lr_follows_scheduler and not trainer.lr_scheduler_configs:
            rank_zero_warn(
                "TwoDRecStrategy(embedding_lr_follows_scheduler=True), but configure_optimizers returned no LR "
                "scheduler: the tables keep embedding_optimizer.lr."
            )

    @property
    def embedding_learning_rate(self) -> EmbeddingLearningRate:
        """The tables' learning rate (base and factor); available after the optimizers are set up."""
        return _available(self.runtime.embedding_lr, "embedding_learning_rate", "set up the optimizers")

    def _scheduler_factor(self) -> Optional[float]:
        """The first LR scheduler's factor (lr / initial_lr), when the tables follow it."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if not self._embedding_lr_follows_scheduler or trainer is None or not trainer.lr_scheduler_configs:
            return None
        group = trainer.lr_scheduler_configs[0].scheduler.optimizer.param_groups[0]
        return group["lr"] / group.get("initial_lr", group["lr"])

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[LightningModule, Module]] = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.optimizers and _unwrap_optimizer(optimizer) is _unwrap_optimizer(self.optimizers[0]):
            if self.runtime.checks_finite:
                self.runtime.check_finite(self._global_step(), before_update=False)
            self.runtime.after_optimizer_step()
        return output

    def sync_replicas(self) -> None:
        """Average the embedding shards (and fused optimizer state) over the replica groups now.

        Runs automatically every ``replica_sync.every_n_steps`` steps and before evaluation, saves
        and the end of training; a no-op in 1D. Every rank must call it.
        """
        self.runtime.sync()

    @property
    def replica_sync_stats(self) -> Optional[SyncStats]:
        """The last replica sync on this rank: rows synced, touched fraction, bytes (None in 1D or before one)."""
        return self.runtime.last_sync_stats

    def _sync_if_pending(self) -> None:
        if self._runtime is not None:
            self._runtime.sync_if_pending()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._runtime is not None:
            self._runtime.before_step(self._scheduler_factor())

    # Strategy hooks: evaluation and the end of training always see one synchronized model.
    on_validation_start = on_test_start = on_predict_start = on_train_end = _sync_if_pending

    # ----------------------------------------------------------------- batches, inputs, non-finite values
    @override
    def process_dataloader(self, dataloader: object) -> object:
        if self._coordination_group is None or self._sharded is None:
            return dataloader
        dmp = self._sharded.dmp
        if self._pipeline_mode == "sparse_dist" and self._input_pipeline is None:
            self._input_pipeline = SparseDistPipeline(dmp, self.root_device)
        return CoordinatedBatches(
            dataloader,  # type: ignore[arg-type]
            group=self._coordination_group,
            validator=self._input_validator,
            validate=self._validate_inputs,
            equal_sizes_required=self._equal_batch_sizes_required,
            pipeline=self._input_pipeline,
            training=lambda: self.lightning_module is not None and self.lightning_module.training,
        )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        if self._runtime is not None and self._runtime.checks_finite:
            loss = output.get("loss") if isinstance(output, Mapping) else output
            self._runtime.check_finite(self._global_step(), before_update=True, loss=loss)
        return output

    def _global_step(self) -> int:
        return self.lightning_module.trainer.global_step if self.lightning_module is not None else -1

    @override
    def on_exception(self, exception: BaseException) -> None:
        # A collective that failed usually means a peer died; name it where the rendezvous store can tell.
        if _distributed_is_initialized() and _looks_like_lost_peer(exception):
            lost = report_lost_ranks(self.global_rank, self.world_size, wait_seconds=min(10.0, self._timeout.total_seconds()))
            log.error("TwoDRecStrategy: rank %d: %s", self.global_rank, lost)

    @property
    def data_parallel_table_optimizer(self) -> Optional[Optimizer]:
        """The torch optimizer of the tables planned as data_parallel, or None if there are none."""
        return self._runtime.data_parallel_table_optimizer if self._runtime is not None else None

    @override
    def model_to_device(self) -> None:
        # DistributedModelParallel places every shard on the root device when it is built.
        pass

    # ----------------------------------------------------------------- collectives
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        container = [obj]
        dist.broadcast_object_list(container, src)
        return container[0]

    @override
    def reduce(
        self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Tensor:
        if isinstance(tensor, Tensor):
            with comm_purpose("metrics"):
                return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ----------------------------------------------------------------- checkpoints and teardown
    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = DCPCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:
        self._checkpoint_io = io

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # The sharded tables (and the data-parallel table optimizer) exist only after setup.
        return True

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Every rank writes its shards (Lightning's base strategy would call CheckpointIO on rank 0 only)."""
        self._sync_if_pending()  # replicas agree, so the one that writes speaks for all
        self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Every rank loads its (re-cut) shards in place; returns the rest of the checkpoint."""
        checkpoint = self.checkpoint_io.load_checkpoint(checkpoint_path, weights_only=weights_only)
        self.runtime.restart_sync_cadence()  # every replica loaded the same state
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if "state_dict" in checkpoint:  # a plain (non-DCP) checkpoint dict
            super().load_model_state_dict(checkpoint, strict=strict)
        # else: DCPCheckpointIO already loaded the model in place

    def sharded_checkpoint_state(self) -> ShardedState:
        """This rank's state for DCP: the module's state dict and the embedding optimizer state."""
        return ShardedState(
            model_state_dict=self.lightning_module.state_dict(),  # type: ignore[union-attr]
            sharded_model=self.sharded_model,
            embedding_optimizer=self.embedding_optimizer_config,
            data_parallel_table_optimizer=self.data_parallel_table_optimizer,
        )

    def load_strictly(self) -> bool:
        return bool(getattr(self.lightning_module, "strict_loading", True))

    def restores_optimizer_state(self) -> bool:
        """Only ``fit`` restores optimizer state; evaluation needs the weights alone."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return trainer is not None and trainer.state.fn == TrainerFn.FITTING

    @override
    def teardown(self) -> None:
        # The sharded module stays where it is (Strategy.teardown would move FBGEMM's tables to CPU).
        if self._input_pipeline is not None:  # the model gets its own forwards back
            self._input_pipeline.close()
            self._input_pipeline = None
        if self._runtime is not None:
            self._runtime.comm.stop()
        assert self.cluster_environment is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register(strategy_registry)  # the one registration, also used at import (lightning_recsys._registration)


_T = TypeVar("_T")
_SHARDING_RECORD = "_lightning_recsys_sharding"  # in the module's __dict__: not a submodule, not in state_dict


@dataclass
class _ShardingRecord:
    """What a strategy left on a module it sharded, so a later Trainer's strategy can reuse the shards."""

    sharded: ShardedModel
    settings: dict[str, Any]
    input_validator: InputValidator
    equal_batch_sizes_required: bool
    runtime: Optional[ShardedRuntime] = None  # its accounting and row-tracking hooks are on the shared modules


def _check_reusable(previous: dict[str, Any], current: dict[str, Any]) -> None:
    differing = [f"{name}: {previous[name]!r} then, {current[name]!r} now" for name in previous if previous[name] != current[name]]
    if differing:
        raise ValueError(
            "TwoDRecStrategy: this module's tables were already sharded by an earlier Trainer's strategy with other "
            f"settings ({'; '.join(differing)}). TorchRec replaces the tables in place, so they cannot be re-planned. "
            "Use the same strategy settings and world, or build a fresh model and load a checkpoint into it "
            "(Trainer(...).test(fresh_model, ckpt_path=...))."
        )


def _available(value: Optional[_T], attribute: str, after: str) -> _T:
    if value is None:
        raise RuntimeError(f"TwoDRecStrategy.{attribute} is available only after the Trainer has {after}.")
    return value


def _looks_like_lost_peer(exception: BaseException) -> bool:
    text = str(exception).lower()
    return isinstance(exception, (RuntimeError, dist.DistError)) and any(
        hint in text for hint in ("connection closed", "connection reset", "timed out", "timeout", "broken pipe", "nccl")
    )


def _destroy_process_group_at_exit() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    # The Trainer, strategy and DMP reference each other, so their process groups would otherwise be
    # freed by the collector during interpreter finalization, where gloo's worker threads releasing
    # tensors can no longer take the GIL (the SIGABRT above). Free them now, while Python is whole.
    gc.collect()


def _unwrap_optimizer(optimizer: Any) -> Any:
    return getattr(optimizer, "_optimizer", optimizer)
