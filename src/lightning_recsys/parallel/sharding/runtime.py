"""ShardedRuntime: what a sharded model needs while it trains, in one object, with no Lightning.

It owns the tables' optimizers (FBGEMM's fused one comes with the model; the data-parallel tables'
torch optimizer and the tables' learning rate are made here), the replica sync and its cadence,
the communication accounting, and the non-finite guard. A training loop calls a few methods:

    runtime = ShardedRuntime(sharded, topology, embedding_optimizer=..., replica_sync=..., coordination_group=...)
    runtime.start()
    runtime.strip_embedding_params(dense_optimizers); runtime.make_table_optimizers()
    for batch in batches:
        runtime.before_step(lr_factor)          # accounting, the tables' learning rate
        loss = ...; runtime.check_finite(step, before_update=True, loss=loss)
        loss.backward(); dense_optimizer.step()
        runtime.after_optimizer_step()          # data-parallel tables, replica sync cadence, accounting
    runtime.sync_if_pending(); runtime.close()

``TwoDRecStrategy`` maps Lightning's hooks onto these calls, as Lightning's DDP strategy hands its
periodic averaging to ``PeriodicModelAverager``.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_recsys.parallel.comms import CommAccountant
from lightning_recsys.parallel.comms.lookup_traffic import counted_bytes, lookup_counts, table_routes
from lightning_recsys.parallel.sharding.embedding_hooks import EmbeddingOutputHooks
from lightning_recsys.parallel.step_phases import StepPhaseLabels
from lightning_recsys.parallel.sharding.embedding_lr import EmbeddingLearningRate
from lightning_recsys.parallel.sharding.embedding_optimizer import EmbeddingOptimizerConfig
from lightning_recsys.parallel.sharding.sharded_model import ShardedModel
from lightning_recsys.parallel.sync import ReplicaSyncConfig, ReplicaSynchronizer, SyncStats, SyncTotals
from lightning_recsys.parallel.topology import ParallelTopology, raised_on_every_rank

log = logging.getLogger(__name__)


class ShardedRuntime:
    """The run-time state of one sharded model on this rank.

    Args:
        sharded: what ``shard_model`` returned.
        topology: the rank layout; its replica group (2D) gets a ``ReplicaSynchronizer``.
        embedding_optimizer: the tables' optimizer config (the data-parallel tables' torch optimizer
            and the base learning rate come from it).
        replica_sync: what the replica sync averages and how often (no synchronizer when every table
            is ``data_parallel``: ``nothing_to_sync``).
        coordination_group: a CPU-capable group over every rank, for the non-finite guard.
    """

    def __init__(
        self,
        sharded: ShardedModel,
        topology: ParallelTopology,
        *,
        embedding_optimizer: EmbeddingOptimizerConfig,
        replica_sync: ReplicaSyncConfig,
        coordination_group: Optional[dist.ProcessGroup],
    ) -> None:
        self.sharded = sharded
        self.topology = topology
        self.embedding_optimizer = embedding_optimizer
        self._coordination_group = coordination_group
        replica_group = topology.replica_process_group()
        self.replica_sync: Optional[ReplicaSynchronizer] = None
        # 2D with every table data_parallel: DDP keeps the tables equal on every rank, and a synchronizer
        # would only run empty syncs (and report "0 of 0 rows"); there is none, as in 1D.
        self.nothing_to_sync = replica_group is not None and not sharded.model_parallel_tables
        if replica_group is not None and not self.nothing_to_sync:
            self.replica_sync = ReplicaSynchronizer.for_sharded_modules(
                [sharded.dmp.module.get_submodule(fqn) for fqn in sharded.embedding_module_fqns],
                sharded.fused_optimizer,
                replica_group,
                config=replica_sync,
                count_aware=replica_sync.averages_over_touching_replicas(embedding_optimizer.is_adaptive),
            )
            # Each sharding group initialized its own shards (TorchRec re-initializes them); start equal.
            self.replica_sync.broadcast_from_first_replica()
        self.comm = CommAccountant(topology, topology.sharding_process_group(), replica_group)
        self._lookup_hooks: list[Any] = []  # forward pre-hooks that count each sequence lookup's bytes by feature
        self.data_parallel_table_optimizer: Optional[Optimizer] = None
        self.embedding_lr: Optional[EmbeddingLearningRate] = None
        self.output_hooks: Optional[EmbeddingOutputHooks] = None
        # Each sharded embedding module with its TorchRec lookups (a plain list, so not its submodules).
        self._lookups: list[tuple[nn.Module, list[nn.Module]]] = [
            (owner, list(owner._lookups))
            for fqn in sharded.embedding_module_fqns
            for owner in sharded.dmp.module.get_submodule(fqn).modules()
            if getattr(owner, "_lookups", None)
        ]
        # torch.profiler ranges of input dist, lookup and all-to-all, hooked in while a profiler records.
        self.phase_labels = StepPhaseLabels([owner for owner, _ in self._lookups])

    def describe_replica_sync(self) -> str:
        """What the replica sync does, with the average ``ReplicaSyncConfig(average="auto")`` resolved to."""
        sync = self.replica_sync
        if sync is None:
            return "no replica sync (1D, or every table data_parallel)."
        over = "the replicas that touched it" if sync.count_aware and sync.tracks_rows else "all replicas"
        return (
            f"replica sync of {sync.config.describe()}; each row's change is averaged over {over} "
            f"(average={sync.config.average!r}, embedding optimizer {self.embedding_optimizer.name})."
        )

    # ----------------------------------------------------------------- set-up
    def start(self, sequence_wire_bytes: tuple[float, float] = (4.0, 4.0)) -> None:
        """Start accounting this process's collectives, and the sequence all-to-all's bytes by feature.

        ``sequence_wire_bytes``: bytes per value (forward, backward) of the sequence all-to-all
        (``EffectiveQComms.wire_bytes("sequence_all_to_all")``).
        """
        self.comm.start()
        if not self._lookup_hooks:
            self._lookup_hooks = install_lookup_accounting(self.sharded, self.topology, self.comm, sequence_wire_bytes)

    def install_output_hooks(self, *, check_finite: bool, grad_scale: Optional[Callable[[], Tensor]]) -> None:
        """Hooks on the looked-up embeddings, once per model, if the finite guard or loss scaling needs them."""
        hooks = EmbeddingOutputHooks(check_finite=check_finite, grad_scale=grad_scale)
        if hooks.needed and self.output_hooks is None:
            modules = {fqn: self.sharded.dmp.module.get_submodule(fqn) for fqn in self.sharded.embedding_module_fqns}
            hooks.install(modules)
            self.output_hooks = hooks

    def strip_embedding_params(self, dense_optimizers: list[Optimizer]) -> int:
        """Remove the tables' parameters (and their state) from the dense optimizers; returns how many."""
        removed = 0
        for optimizer in dense_optimizers:
            for group in optimizer.param_groups:
                kept = [p for p in group["params"] if not self.sharded.is_embedding_param(p)]
                removed += len(group["params"]) - len(kept)
                group["params"] = kept
            # Some optimizers (Adagrad) create state eagerly; state for a removed param breaks state_dict().
            for param in [p for p in optimizer.state if self.sharded.is_embedding_param(p)]:
                del optimizer.state[param]
        return removed

    def make_table_optimizers(self) -> None:
        """The data-parallel tables' torch optimizer (FBGEMM's rule) and the tables' learning rate."""
        params = self.sharded.data_parallel_table_params
        self.data_parallel_table_optimizer = self.embedding_optimizer.make_torch_optimizer(params) if params else None
        self.embedding_lr = EmbeddingLearningRate(
            self.embedding_optimizer.lr, self.sharded.fused_optimizer, self.data_parallel_table_optimizer
        )

    # ----------------------------------------------------------------- per step
    def before_step(self, lr_factor: Optional[float] = None) -> None:
        """A training step starts: account its collectives; move the tables' learning rate to ``lr_factor``."""
        if lr_factor is not None and self.embedding_lr is not None:
            self.embedding_lr.set_factor(lr_factor)
        self.align_lookup_modes()
        self.phase_labels.follow_profiler()
        self.comm.begin_step()

    def align_lookup_modes(self) -> None:
        """Give TorchRec's lookups (and their fused kernels) their sharded module's training mode.

        A loop that restores modes by setting ``.training`` on ``named_modules()`` (Lightning does after
        every validation) never reaches the lookups, which then stay in eval mode: the replica sync's
        row trackers skip eval-mode lookups, so the replicas would drift apart unseen."""
        for owner, lookups in self._lookups:
            for lookup in lookups:
                if any(m.training != owner.training for m in lookup.modules()):
                    lookup.train(owner.training)

    def after_optimizer_step(self) -> None:
        """The dense step is done: step the data-parallel tables, let the replica sync run on its cadence."""
        optimizer = self.data_parallel_table_optimizer
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if self.replica_sync is not None:
            self.replica_sync.step_ended()
        self.comm.end_step()

    @property
    def checks_finite(self) -> bool:
        return self.output_hooks is not None and self.output_hooks.checks_finite

    def check_finite(self, step: int, *, before_update: bool, loss: Any = None) -> None:
        """Every rank learns whether any saw a non-finite value since the last check, and all raise together."""
        assert self.output_hooks is not None, "install_output_hooks(check_finite=True) first"
        if loss is not None:
            self.output_hooks.note_loss(loss)
        local = self.output_hooks.take_nonfinite()
        kinds = list(local)
        flags = torch.tensor([int(bool(local[k])) for k in kinds])
        gathered = [torch.empty_like(flags) for _ in range(dist.get_world_size(self._coordination_group))]
        dist.all_gather(gathered, flags, group=self._coordination_group)
        found = {k: [r for r, f in enumerate(gathered) if f[i]] for i, k in enumerate(kinds)}
        if any(found.values()):
            what = "; ".join(f"{k} on rank(s) {ranks}" + (f" ({local[k]} here)" if local[k] else "") for k, ranks in found.items() if ranks)
            when = "stopped before the embedding update" if before_update else "the tables' update at this step is already applied"
            raise raised_on_every_rank(FloatingPointError(
                f"TwoDRecStrategy(check_finite): non-finite values at step {step}: {what}; {when}. Lower the learning "
                "rate or check the inputs, and resume from the last checkpoint."
            ))

    # ----------------------------------------------------------------- replica sync
    def sync(self) -> None:
        """Average the replicas now, after applying an overlapped sync in flight (a no-op in 1D or with
        ``nothing_to_sync``). Every rank must call it."""
        if self.replica_sync is not None:
            self.replica_sync.sync()

    def sync_if_pending(self) -> None:
        """Apply an overlapped sync in flight, then average the replicas if any step ran since the last sync
        (before evaluation, saves, the end)."""
        if self.replica_sync is not None:
            self.replica_sync.sync_if_pending()

    def sync_before_save(self) -> None:
        """``sync_if_pending``, and with ``ReplicaSyncConfig(optimizer_state=False)`` the replicas' optimizer
        state averaged too: a checkpoint holds one replica's state, and every replica resumes from it."""
        if self.replica_sync is not None:
            self.replica_sync.sync_if_pending()
            self.replica_sync.average_own_state()

    def restart_sync_cadence(self) -> None:
        """After a checkpoint load: every replica holds the loaded values, so nothing is pending."""
        if self.replica_sync is not None:
            self.replica_sync.reset()

    @property
    def last_sync_stats(self) -> Optional[SyncStats]:
        return self.replica_sync.last_sync_stats if self.replica_sync is not None else None

    @property
    def sync_totals(self) -> Optional[SyncTotals]:
        """Every replica sync so far on this rank: count, rows per sync, touched fraction, bytes (None in 1D or
        with ``nothing_to_sync``)."""
        return self.replica_sync.totals if self.replica_sync is not None else None

    def close(self) -> None:
        """Stop accounting and remove this runtime's hooks from the model (a later runtime may reuse it)."""
        self.comm.stop()
        for handle in self._lookup_hooks:
            handle.remove()
        self._lookup_hooks = []
        if self.replica_sync is not None:
            self.replica_sync.close()
        if self.output_hooks is not None:
            self.output_hooks.remove()
            self.output_hooks = None
        self.phase_labels.remove()


def install_lookup_accounting(
    sharded: ShardedModel, topology: ParallelTopology, comm: CommAccountant, wire_bytes: tuple[float, float]
) -> list[Any]:
    """A forward pre-hook on each sharded ``EmbeddingCollection`` that files its lookup's bytes by feature with ``comm``."""
    from torchrec.distributed.embedding import ShardedEmbeddingCollection

    rank = dist.get_rank()
    group = topology.sharding_group_of(rank)
    handles = []
    for fqn in sharded.embedding_module_fqns:
        module = sharded.dmp.module.get_submodule(fqn)
        if not isinstance(module, ShardedEmbeddingCollection):
            continue
        # The table configs and the dedup flag as ShardedEmbeddingCollection.__init__ keeps them (torchrec/distributed/embedding.py).
        features = {config.name: tuple(config.feature_names) for config in module._embedding_configs}
        routes = table_routes(features, sharded.plan.plan.get(fqn, {}), group)
        dedup = bool(module._use_index_dedup)
        if not routes:
            continue

        converters = [
            (route, partial(counted_bytes, route=route, wire_bytes=wire_bytes, topology=topology, rank=rank)) for route in routes
        ]

        def count(_module: nn.Module, args: tuple[Any, ...], fqn: str = fqn, converters: Any = converters, dedup: bool = dedup) -> None:
            if args and comm.in_step:  # evaluation lookups have no backward: not counted
                for route, to_bytes in converters:
                    comm.record_lookup((fqn, route.table), lookup_counts(args[0], route, index_dedup=dedup), to_bytes)

        handles.append(module.register_forward_pre_hook(count))
    return handles

