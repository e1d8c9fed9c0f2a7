"""TwoDRecStrategy: TorchRec model parallelism for the embedding tables, data parallelism for the rest."""

from __future__ import annotations

import atexit
import logging
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_recsys._registration import STRATEGY_NAME, register
from lightning_recsys.parallel import EmbeddingOptimizerConfig, ParallelTopology, ShardedModel
from lightning_recsys.parallel.comms import EffectiveQComms, QCommsConfig, resolve_qcomms
from lightning_recsys.parallel.input import PIPELINE_MODES, GuardConfig, PipelineMode, SparseDistPipeline
from lightning_recsys.parallel.sharding import ShardedRuntime, silence_known_upstream_warnings
from lightning_recsys.parallel.sync import ReplicaSyncConfig
from lightning_recsys.parallel.topology import (
    Layout,
    attempt_scoped_store,
    check_topology_arguments,
    destroy_process_group_at_exit,
    diagnose_failure,
    raised_on_every_rank,
    was_raised_on_every_rank,
)
from lightning_recsys.planner import PlanningConfig, PlanReport, embedding_tables
from lightning_recsys.strategies.batches import CoordinatedBatchHooks
from lightning_recsys.strategies.checkpoint_hooks import ShardedCheckpointHooks, silence_no_last_checkpoint_yet
from lightning_recsys.strategies.checkpoint_io import DCPCheckpointIO
from lightning_recsys.strategies.collectives import ProcessGroupCollectives
from lightning_recsys.strategies.lightning_hooks import SyncReplicasFirst
from lightning_recsys.strategies.manual_optimization import DenseDDPForwardRedirection, ManualOptimizationHooks
from lightning_recsys.strategies.preemption import PREEMPTED_EXIT_CODE, CoordinatedSigterm
from lightning_recsys.strategies.runtime_hooks import ShardedRuntimeHooks, available
from lightning_recsys.strategies.sharding import ShardedSetup, shard_or_reuse
from lightning_recsys.strategies.validation import check_device_support, check_launch_layout, check_trainer_settings

log = logging.getLogger(__name__)


class TwoDRecStrategy(
    ShardedRuntimeHooks,
    CoordinatedBatchHooks,
    ShardedCheckpointHooks,
    ManualOptimizationHooks,
    CoordinatedSigterm,
    ProcessGroupCollectives,
    ParallelStrategy,
):
    """Shard a LightningModule's TorchRec embedding tables across ranks; keep dense layers data-parallel.

    The strategy finds every ``EmbeddingBagCollection``/``EmbeddingCollection`` in the module, plans
    it (``planning``), and wraps the module in ``DistributedModelParallel``: embedding lookups go
    through TorchRec's all-to-all, dense parameters are synced by DDP over all ranks.

    2D parallelism: the world is split into sharding groups of ``sharding_group_size`` ranks (by
    default one node each). Tables are sharded inside a group, so the all-to-all stays on the
    node's links; every group holds a full replica, and replicas are averaged over the replica
    group (an all-reduce across nodes) as ``replica_sync`` says, and before validation, test,
    predict, checkpoint saves and the end of training.

    Optimizers: model-parallel tables are updated inside backward by FBGEMM's fused optimizer
    (``embedding_optimizer``); data-parallel tables get the same rule as a torch optimizer, stepped
    with the dense optimizers. What ``configure_optimizers`` returns is used for the dense
    parameters only (embedding parameters are removed from it), so LR schedulers and gradient
    clipping keep working on them.

    The strategy maps Lightning's hooks onto ``parallel.sharding.ShardedRuntime`` (table optimizers,
    replica sync, accounting, finite guard); each config documents its own fields.

    Args:
        sharding_group_size: ranks the tables are sharded over; default: the devices per node.
            Equal to the world size means 1D (no replicas).
        layout: ``all_to_all_optimized`` (default: contiguous, node-local sharding groups; the
            replica all-reduce crosses nodes) or ``all_reduce_optimized`` (strided groups; the
            all-to-all crosses nodes and replicas sit inside a node).
        qcomms: precision of the embedding collectives: a preset (``"fp32"``, ``"bf16"``,
            ``"fp16"``, ``"fp8"``, ``"int8"``) or a ``QCommsConfig``; default fp32 (off).
        replica_sync: the 2D replica sync, a ``ReplicaSyncConfig``.
        embedding_optimizer: the tables' optimizer, an ``EmbeddingOptimizerConfig`` (default:
            row-wise Adagrad, lr 0.05).
        planning: how the sharding plan is made, a ``PlanningConfig`` (default: TorchRec's planner,
            every sharding type that runs on the device).
        guard: the per-step input and non-finite checks, a ``GuardConfig``.
        pipeline: ``"sparse_dist"`` (default): each training and evaluation batch's sparse input
            distribution (on CUDA also its host-to-device copy) starts during the step before it,
            as in TorchRec's ``TrainPipelineSparseDist``; same results as ``"off"``. A model it cannot
            trace falls back to ``"off"`` with one warning; a module whose input changes between
            the dataloader and the module raises. ``"off"``: the distribution runs inside the step.
        process_group_backend: ``gloo`` or ``nccl``; default: nccl on CUDA, gloo on CPU.
        process_group_timeout: seconds a collective may wait before the job fails (default 1800,
            which leaves room for planning large models).
    """

    strategy_name = STRATEGY_NAME

    def __init__(
        self,
        *,
        sharding_group_size: Optional[int] = None,
        layout: Layout = "all_to_all_optimized",
        qcomms: Union[str, QCommsConfig, None] = None,
        replica_sync: Optional[ReplicaSyncConfig] = None,
        embedding_optimizer: Optional[EmbeddingOptimizerConfig] = None,
        planning: Optional[PlanningConfig] = None,
        guard: Optional[GuardConfig] = None,
        pipeline: PipelineMode = "sparse_dist",
        process_group_backend: Optional[str] = None,
        process_group_timeout: float = 1800.0,
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
        check_topology_arguments(sharding_group_size, layout)
        for name, value, kind in (
            ("replica_sync", replica_sync, ReplicaSyncConfig),
            ("embedding_optimizer", embedding_optimizer, EmbeddingOptimizerConfig),
            ("planning", planning, PlanningConfig),
            ("guard", guard, GuardConfig),
        ):
            if value is not None and not isinstance(value, kind):
                article = "an" if kind.__name__[0] in "AEIOU" else "a"
                raise TypeError(f"TwoDRecStrategy({name}={value!r}): expected {article} {kind.__name__}, or None for the defaults.")
        if pipeline not in PIPELINE_MODES:
            raise ValueError(f"pipeline={pipeline!r} is not one of {list(PIPELINE_MODES)}.")
        if not process_group_timeout > 0:
            raise ValueError(f"process_group_timeout={process_group_timeout} must be > 0 seconds.")
        if process_group_backend not in (None, "gloo", "nccl"):
            raise ValueError(f"process_group_backend={process_group_backend!r} must be 'gloo', 'nccl' or None.")
        self.sharding_group_size = sharding_group_size
        self.layout: Layout = layout
        self.qcomms_config = QCommsConfig.parse(qcomms)
        self.replica_sync_config = replica_sync or ReplicaSyncConfig()
        self.embedding_optimizer_config = embedding_optimizer or EmbeddingOptimizerConfig()
        self.planning = planning or PlanningConfig()
        self.guard = guard or GuardConfig()
        self.pipeline: PipelineMode = pipeline
        self._input_pipeline: Optional[SparseDistPipeline] = None
        self._process_group_backend = process_group_backend
        self._timeout = timedelta(seconds=process_group_timeout)
        self._num_nodes = 1
        self._topology: Optional[ParallelTopology] = None
        self._coordination_group: Optional[dist.ProcessGroup] = None
        self._setup: Optional[ShardedSetup] = None
        self._runtime: Optional[ShardedRuntime] = None
        self._forward_redirection = DenseDDPForwardRedirection(self)
        self._scheduler_base_lr: Optional[float] = None
        silence_no_last_checkpoint_yet()  # before fit parses ckpt_path; on_train_start says it in one INFO line

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
        return available(self._setup, "sharded_model", "set up the model").sharded

    @property
    def collective_timeout(self) -> timedelta:
        """``process_group_timeout``: what bounds every collective of the job, its process groups' and the checkpoint writers'."""
        return self._timeout

    @property
    def topology(self) -> ParallelTopology:
        """The 2D rank layout (sharding and replica groups); available once the environment is set up."""
        return available(self._topology, "topology", "set up the environment")

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``("replicate", "shard")`` device mesh; also readable as ``LightningModule.device_mesh``."""
        return self.topology.device_mesh(self.root_device.type, timeout=self._timeout)

    @property
    def effective_qcomms(self) -> EffectiveQComms:
        """The precision each embedding collective really uses, per direction, and any fallbacks (the plan's, after setup)."""
        return self._setup.effective_qcomms if self._setup is not None else resolve_qcomms(self.qcomms_config)

    @property
    def plan_report(self) -> Optional[PlanReport]:
        """The sharding plan's report (rank 0, after setup; None on other ranks)."""
        return self._setup.plan_report if self._setup is not None else None

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        silence_known_upstream_warnings()  # before planning and sharding, where most of them come from
        assert self.cluster_environment is not None
        check_launch_layout(self.cluster_environment, devices=self.num_processes, num_nodes=self.num_nodes)
        super().setup_environment()
        self.set_world_ranks()
        topology = ParallelTopology.for_world(
            ranks_per_node=self.num_processes, num_nodes=self.num_nodes, sharding_group_size=self.sharding_group_size, layout=self.layout
        )
        if topology != self._topology:  # a later fit/validate/test keeps the mesh (and groups) it already has
            self._topology = topology
        module = self.lightning_module
        check_device_support(
            self.root_device.type, self._process_group_backend, self.embedding_optimizer_config, self.planning, two_d=not topology.is_1d,
            table_names=[t.name for t in embedding_tables(module)] if module is not None else (),
        )
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        if not _distributed_is_initialized():  # else the user (or a previous Trainer) owns the process group
            device_id = self.root_device if self.root_device.type != "cpu" else None
            env = self.cluster_environment
            # Under torchrun, the keys of this restart attempt only (attempt_scoped_store says why).
            store = attempt_scoped_store(
                env.main_address, env.main_port, rank=self.global_rank, world_size=self.world_size, timeout=self._timeout
            )
            kwargs: dict[str, Any] = {"store": store} if store is not None else {}
            _init_dist_connection(env, backend, timeout=self._timeout, device_id=device_id, **kwargs)
            atexit.register(destroy_process_group_at_exit)
        # A CPU group for the per-step batch handshake and failure diagnosis (gloo: monitored_barrier).
        if self._coordination_group is None:
            self._coordination_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=self._timeout)
        for warning in self._topology.layout_warnings():
            rank_zero_warn(warning)
        if topology.is_1d and self.replica_sync_config != ReplicaSyncConfig():
            rank_zero_warn(
                f"replica_sync={self.replica_sync_config} has no effect: this run is 1D (sharding_group_size "
                f"{topology.sharding_group_size} = world size {topology.world_size}, one replica). Set sharding_group_size "
                "to the ranks per node (or fewer) for 2D."
            )
        mesh = self.device_mesh  # collective: every rank builds it here
        if self.lightning_module is not None:
            self.lightning_module._device_mesh = mesh

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ----------------------------------------------------------------- model and optimizers
    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        check_trainer_settings(trainer, self.precision_plugin, self.checkpoint_io)
        self._shard(self.lightning_module)
        self.model = self.sharded_model.dmp
        self._coordinate_sigterm(trainer)
        self.runtime.start(sequence_wire_bytes=self.effective_qcomms.wire_bytes("sequence_all_to_all"))
        scaler = getattr(self.precision_plugin, "scaler", None)  # fp16 loss scaling (16-mixed)
        self.runtime.install_output_hooks(
            check_finite=self.guard.check_finite or getattr(trainer, "_detect_anomaly", False),
            grad_scale=scaler._get_scale_async if scaler is not None else None,
        )
        assert isinstance(self.checkpoint_io, DCPCheckpointIO)
        self.checkpoint_io.connect(self)
        if not any(isinstance(c, SyncReplicasFirst) for c in trainer.callbacks):
            # First, so the user's callbacks (and the module) already see one model in these hooks.
            trainer.callbacks.insert(0, SyncReplicasFirst(self))
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _shard(self, module: LightningModule) -> None:
        if self._setup is not None and self._setup.sharded.dmp.module is module:
            return  # a later fit/validate/test call on the same, already sharded module
        setup = shard_or_reuse(self, module)
        if self._runtime is not None:
            self._runtime.close()
        self._runtime = setup.runtime = ShardedRuntime(
            setup.sharded, self.topology, embedding_optimizer=self.embedding_optimizer_config,
            replica_sync=self.replica_sync_config, coordination_group=self._coordination_group,
        )
        self._setup = setup
        if self._runtime.replica_sync is not None:
            rank_zero_info(f"TwoDRecStrategy: {self._runtime.describe_replica_sync()}")

    @override
    def on_train_end(self) -> None:
        self._sync_if_pending()
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        # Lightning warns about a zero-length loader, but an iterable one that yields nothing passes silently.
        asked_for_steps = trainer is not None and trainer.max_steps != 0 and trainer.max_epochs != 0 and trainer.limit_train_batches != 0
        if asked_for_steps and trainer.global_step == 0:  # type: ignore[union-attr]
            rank_zero_warn(
                "fit ran no training step: the train dataloader yielded no batch on some rank. A split with fewer "
                "examples than one global batch yields none (the final partial global batch is dropped); check the "
                "train files and global_batch_size."
            )

    @override
    def on_exception(self, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException) and self._sigterm_agreed:
            raised_on_every_rank(exception)  # the handshake stopped every rank on the same step
            exception.code = PREEMPTED_EXIT_CODE  # not 0: the run did not finish
            if self._requeue_agreed and self.lightning_module is not None:
                self._save_and_requeue(self.lightning_module.trainer)  # SLURM's requeue signal, on every rank at this step
        if self._input_pipeline is not None and not was_raised_on_every_rank(exception):
            # This rank failed alone (its own step, or a collective): its peers are not at the batch
            # distributions it started, and finishing them at teardown would wait out the timeout.
            self._input_pipeline.close(wait=False)
            self._input_pipeline = None
        # A rank failing alone leaves its error for its peers; a failed collective names the ranks lost where the store can tell.
        lost = diagnose_failure(
            self.global_rank, self.world_size, exception, wait_seconds=min(10.0, self._timeout.total_seconds()),
            store_host_ranks=range(self.num_processes),  # torchrun's store: with node 0, global ranks 0..per node - 1
            stop_early=lambda: self._sigterm_pending,  # torchrun stops the survivors of a dead rank with SIGTERM
        ) if _distributed_is_initialized() else None
        if lost is not None:
            log.error("TwoDRecStrategy: rank %d: %s", self.global_rank, lost)
            exception.add_note(f"TwoDRecStrategy: rank {self.global_rank}: {lost}")  # the raised error names them too

    @override
    def model_to_device(self) -> None:
        # DistributedModelParallel places every shard on the root device when it is built.
        pass

    # ----------------------------------------------------------------- teardown
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
        register(strategy_registry, cls)  # the one registration, also used at import (lightning_recsys._registration)

