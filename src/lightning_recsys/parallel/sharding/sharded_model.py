"""Sharding a model's TorchRec embedding modules with DistributedModelParallel, in 1D or 2D.

2D is built from TorchRec's public pieces (its own ``DMPCollection`` asserts CUDA): DMP gets a
``ShardingEnv`` over this rank's sharding group and a plan made for one group whose shard
placements are remapped to global ranks; the dense part is wrapped in DDP over the global group.
"""

# No `from __future__ import annotations`: DDP checks the comm hook's `bucket` annotation at runtime.
import copy
import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.remote_device import _remote_device
from torch.nn.parallel import DistributedDataParallel
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    EnumerableShardingSpec,
    ModuleSharder,
    ShardedModule,
    ShardingEnv,
    ShardingPlan,
    ShardingType,
)
from torchrec.optim.keyed import KeyedOptimizer

from lightning_recsys.parallel.comms import (
    comm_purpose,
    dense_grads_hook,
    staged_all_reduce_hook,
    uses_staged_all_reduce,
)
from lightning_recsys.parallel.step_phases import DENSE_ALL_REDUCE, step_phase
from lightning_recsys.parallel.topology import ParallelTopology

log = logging.getLogger(__name__)

EMBEDDING_MODULE_TYPES: tuple[type[nn.Module], ...] = (EmbeddingBagCollection, EmbeddingCollection)


@dataclass
class ShardedModel:
    """A module whose embedding modules were sharded in place, and what the optimizers need to know."""

    dmp: DistributedModelParallel
    plan: ShardingPlan
    embedding_module_fqns: list[str]
    # Tables planned as data_parallel are plain DDP parameters that FBGEMM does not update in
    # backward, so they need a torch optimizer (see EmbeddingOptimizerConfig.make_torch_optimizer).
    data_parallel_table_params: list[nn.Parameter]
    embedding_param_ids: frozenset[int]
    dense_all_reduce_staged: bool = False  # 2D on gloo across nodes: inside a node, then across (dense_all_reduce)

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        """The optimizer FBGEMM runs inside backward for the model-parallel tables."""
        return self.dmp.fused_optimizer

    @property
    def model_parallel_tables(self) -> list[str]:
        """The tables planned other than ``data_parallel``: those whose shards a 2D replica sync averages."""
        return [
            name
            for module_plan in self.plan.plan.values()
            if isinstance(module_plan, EmbeddingModuleShardingPlan)
            for name, sharding in module_plan.items()
            if sharding.sharding_type != ShardingType.DATA_PARALLEL.value
        ]

    def is_embedding_param(self, param: nn.Parameter) -> bool:
        return id(param) in self.embedding_param_ids

    @property
    def dense_ddp(self) -> Optional[DistributedDataParallel]:
        """The DDP that all-reduces the dense (and data-parallel table) gradients; None if DMP made none."""
        wrapped = self.dmp._dmp_wrapped_module
        return wrapped if isinstance(wrapped, DistributedDataParallel) else None


def find_embedding_modules(module: nn.Module) -> dict[str, nn.Module]:
    """The TorchRec embedding modules of ``module`` by fully qualified name, outermost only."""
    found: dict[str, nn.Module] = {}
    for fqn, sub in module.named_modules():
        if isinstance(sub, EMBEDDING_MODULE_TYPES) and not any(fqn.startswith(p + ".") for p in found):
            found[fqn] = sub
    return found


def shard_model(
    module: nn.Module,
    *,
    topology: ParallelTopology,
    device: torch.device,
    sharders: list[ModuleSharder[nn.Module]],
    plan: ShardingPlan,
    dense_grads_precision: str = "fp32",
) -> ShardedModel:
    """Shard ``module``'s embedding modules over this rank's sharding group; wrap the rest in DDP.

    Embedding tables that already hold values (not on the meta device) keep them: TorchRec would
    re-initialize every shard, so the values are copied into the shards after sharding.
    """
    embedding_modules = find_embedding_modules(module)
    if not embedding_modules:
        raise ValueError(
            f"{type(module).__name__} has no torchrec EmbeddingBagCollection or EmbeddingCollection, so there "
            "is nothing for TwoDRecStrategy to shard. Use strategy='ddp' for dense-only models."
        )
    initial_values = {
        fqn: {k: v.detach().clone() for k, v in sub.state_dict().items() if not v.is_meta}
        for fqn, sub in embedding_modules.items()
    }
    env = ShardingEnv.from_process_group(topology.sharding_process_group())
    wrapper = GlobalDataParallelWrapper(dense_grads_precision, topology=topology)
    dmp = DistributedModelParallel(
        module,
        env=env,
        device=device,
        plan=remap_plan_to_global_ranks(plan, topology, dist.get_rank(), device),
        sharders=sharders,
        data_parallel_wrapper=wrapper,
    )
    unwrapped = dmp.module
    for fqn, values in initial_values.items():
        _copy_into_shards(unwrapped.get_submodule(fqn).state_dict(), values)

    embedding_params = [p for fqn in embedding_modules for p in unwrapped.get_submodule(fqn).parameters()]
    data_parallel_params = [p for p in embedding_params if getattr(p, "_in_backward_optimizers", None) is None]
    # DDP broadcast the data-parallel tables before the copy above; every rank must start from one copy
    # (global rank 0's), whatever its RNG state was when the model was built.
    with torch.no_grad():
        for param in data_parallel_params:
            dist.broadcast(param.data, src=0)
    return ShardedModel(
        dmp=dmp,
        plan=plan,
        embedding_module_fqns=list(embedding_modules),
        data_parallel_table_params=data_parallel_params,
        embedding_param_ids=frozenset(id(p) for p in embedding_params),
        dense_all_reduce_staged=wrapper.staged,
    )


def remap_plan_to_global_ranks(
    plan: ShardingPlan, topology: ParallelTopology, rank: int, device: torch.device
) -> ShardingPlan:
    """A copy of ``plan`` (made for one sharding group) whose shard placements name global ranks.

    ``ParameterSharding.ranks`` stay group-local: TorchRec indexes tables by them against the
    ShardingEnv's rank. The placements are global because ShardedTensor checks them against the
    sharding process group's global ranks.
    """
    group = topology.sharding_group_of(rank)
    remapped = copy.deepcopy(plan)
    for module_plan in remapped.plan.values():
        if not isinstance(module_plan, EmbeddingModuleShardingPlan):
            continue
        for sharding in module_plan.values():
            spec = sharding.sharding_spec
            if not isinstance(spec, EnumerableShardingSpec):
                continue
            for shard in spec.shards:
                assert shard.placement is not None
                global_rank = group[shard.placement.rank()]
                placement_device = "cpu" if device.type == "cpu" else f"{device.type}:{topology.local_rank(global_rank)}"
                shard.placement = _remote_device(f"rank:{global_rank}/{placement_device}")
    return remapped


class GlobalDataParallelWrapper(DefaultDataParallelWrapper):
    """DDP for the unsharded parameters over the global group, not the sharding group DMP was given.

    The all-reduce goes through a Python comm hook (DDP's own, in fp32, fp16 or bf16), so
    communication accounting can see its bytes. In 2D on gloo across nodes it runs in two stages
    (``dense_all_reduce``): inside the group that stays on a node, then across the other.
    """

    def __init__(self, dense_grads_precision: str = "fp32", topology: Optional[ParallelTopology] = None) -> None:
        super().__init__()
        self._precision = dense_grads_precision
        self._topology = topology
        self.staged = False  # set by wrap(): whether the dense all-reduce runs in two stages

    def _dense_hook(self) -> Any:
        topology = self._topology
        self.staged = topology is not None and uses_staged_all_reduce(topology, dist.get_backend())
        if self.staged:
            assert topology is not None
            return staged_all_reduce_hook(topology, self._precision)
        return dense_grads_hook(self._precision)

    def _ddp_wrap(
        self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device, ddp_ignore_param_names: set[str]
    ) -> None:
        """DDP as TorchRec builds it, but with the dense buffers synced from rank 0 as Lightning's DDP does.

        TorchRec passes ``broadcast_buffers=False``, which also skips the initial sync: a dense
        buffer (a BatchNorm's running statistics, a running mean) then started and stayed different
        on every rank, so the ranks evaluated different models. Here the floating-point buffers
        outside the sharded modules are broadcast from rank 0 at construction and before each
        forward that computes gradients (DDP's ``forward_sync_buffers``). The sharded modules' buffers
        (FBGEMM's per-shard state) are rank-local, and integer buffers (counters, index constants such
        as DLRM's ``triu_indices``) are equal everywhere, so neither is broadcast.
        """
        module = dmp._dmp_wrapped_module
        if not set(dict(dmp.named_parameters())) - ddp_ignore_param_names:
            return  # nothing dense to wrap (TorchRec's rule)
        sharded = [fqn for fqn, sub in module.named_modules() if isinstance(sub, ShardedModule)]
        rank_local = {
            name for name, buffer in module.named_buffers()
            if not buffer.is_floating_point() or any(name.startswith(f"{fqn}.") for fqn in sharded)
        }
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ddp_ignore_param_names | rank_local)
        dmp._dmp_wrapped_module = DistributedDataParallel(
            module.to(device),
            device_ids=None if device.type == "cpu" else [device],
            process_group=env.process_group,
            gradient_as_bucket_view=True,
            forward_sync_buffers=True,
            static_graph=self._static_graph,
            find_unused_parameters=self._find_unused_parameters,
            bucket_cap_mb=self._bucket_cap_mb,
        )

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        world = dist.group.WORLD
        super().wrap(dmp, ShardingEnv.from_process_group(world), device)  # type: ignore[arg-type]
        ddp = dmp._dmp_wrapped_module
        if isinstance(ddp, DistributedDataParallel):
            hook = self._dense_hook()

            def accounted_hook(process_group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
                with comm_purpose("dense_grads"), step_phase(DENSE_ALL_REDUCE):
                    return hook(process_group, bucket)

            ddp.register_comm_hook(world, accounted_hook)


@torch.no_grad()
def _copy_into_shards(sharded_state: dict[str, object], full_values: dict[str, torch.Tensor]) -> None:
    for key, full in full_values.items():
        target = sharded_state.get(key)
        if isinstance(target, ShardedTensor):
            for shard in target.local_shards():
                index = tuple(slice(o, o + s) for o, s in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes))
                shard.tensor.copy_(full[index])
        elif isinstance(target, torch.Tensor):
            target.copy_(full)
        elif target is not None:
            raise TypeError(f"cannot copy initial values into {key!r} of type {type(target).__name__}")


def local_shards(module: nn.Module) -> dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]:
    """This rank's pieces of every sharded tensor in ``module``: state-dict key -> [(offsets, tensor)].

    Replicated (data-parallel) tensors are reported whole with zero offsets.
    """
    pieces: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
    for key, value in module.state_dict().items():
        if isinstance(value, ShardedTensor):
            pieces[key] = [(tuple(s.metadata.shard_offsets), s.tensor.detach().clone()) for s in value.local_shards()]
        elif isinstance(value, torch.Tensor):
            pieces[key] = [((0,) * value.dim(), value.detach().clone())]
    return pieces
