"""Sharding a model's TorchRec embedding modules with DistributedModelParallel."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.types import ModuleSharder, ShardingEnv, ShardingPlan
from torchrec.optim.keyed import KeyedOptimizer

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

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        """The optimizer FBGEMM runs inside backward for the model-parallel tables."""
        return self.dmp.fused_optimizer

    def is_embedding_param(self, param: nn.Parameter) -> bool:
        return id(param) in self.embedding_param_ids


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
    if not topology.is_1d:
        raise NotImplementedError(
            f"sharding_group_size={topology.sharding_group_size} < world size {topology.world_size} (2D) is not "
            "implemented yet; use sharding_group_size equal to the world size."
        )
    initial_values = {
        fqn: {k: v.detach().clone() for k, v in sub.state_dict().items() if not v.is_meta}
        for fqn, sub in embedding_modules.items()
    }
    env = ShardingEnv.from_process_group(topology.sharding_process_group())
    dmp = DistributedModelParallel(module, env=env, device=device, plan=plan, sharders=sharders)
    unwrapped = dmp.module
    for fqn, values in initial_values.items():
        _copy_into_shards(unwrapped.get_submodule(fqn).state_dict(), values)

    embedding_params = [p for fqn in embedding_modules for p in unwrapped.get_submodule(fqn).parameters()]
    data_parallel_params = [p for p in embedding_params if getattr(p, "_in_backward_optimizers", None) is None]
    return ShardedModel(
        dmp=dmp,
        plan=plan,
        embedding_module_fqns=list(embedding_modules),
        data_parallel_table_params=data_parallel_params,
        embedding_param_ids=frozenset(id(p) for p in embedding_params),
    )


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
