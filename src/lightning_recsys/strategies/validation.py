"""Checks the strategy makes before it builds anything: what the device, the Trainer and the plugins allow."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Optional

from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_recsys.parallel import EmbeddingOptimizerConfig
from lightning_recsys.parallel.sharding import validate_sharding_types
from lightning_recsys.planner import PlanningConfig
from lightning_recsys.strategies.checkpoint_io import DCPCheckpointIO


def check_device_support(
    device_type: str,
    backend: Optional[str],
    embedding_optimizer: EmbeddingOptimizerConfig,
    planning: PlanningConfig,
    *,
    two_d: bool,
    table_names: Sequence[str] = (),
) -> None:
    """Raise if the device, backend, optimizer or allowed sharding types cannot run together.

    ``table_names``: the model's tables, whose ``TableConstraints`` may narrow what any table can be.
    """
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"TwoDRecStrategy runs on accelerator 'cpu' or 'cuda', not {device_type!r}.")
    if device_type == "cpu" and backend == "nccl":
        raise ValueError("process_group_backend='nccl' needs CUDA devices; use 'gloo' (or None) with accelerator='cpu'.")
    allowed = planning.sharding_types
    embedding_optimizer.check_device(device_type, _types_any_table_may_use(planning, table_names))
    if allowed is not None:
        validate_sharding_types(allowed, device_type, "PlanningConfig(sharding_types)", two_d=two_d)
    for table, constraints in planning.table_constraints.items():
        argument = f"table_constraints[{table!r}].sharding_types"
        validate_sharding_types(constraints.sharding_types or [], device_type, argument, two_d=two_d)


def check_launch_layout(environment: ClusterEnvironment, *, devices: int, num_nodes: int) -> None:
    """Raise when ``Trainer(devices, num_nodes)`` splits the world differently from the launcher.

    Lightning checks only the product against the world size, but the strategy builds its node
    layout (the default sharding group is one node, and the plan's intra-node traffic) from
    ``devices``: ``devices=4, num_nodes=1`` under a 2 x 2 torchrun trained 1D across both nodes
    without a word, and ``devices=1`` under 2 processes per node failed with an IndexError on rank 1.
    Runs before any process group exists; torchrun's LOCAL_WORLD_SIZE is the same on every rank, so
    every rank raises alike.
    """
    world = environment.world_size()
    launched = os.environ.get("LOCAL_WORLD_SIZE") if isinstance(environment, TorchElasticEnvironment) else None
    if launched is not None and launched.isdigit() and int(launched) != devices:
        per_node = int(launched)
        nodes = f"num_nodes={world // per_node}" if per_node and world % per_node == 0 else "num_nodes=WORLD_SIZE/LOCAL_WORLD_SIZE"
        raise ValueError(
            f"TwoDRecStrategy: Trainer(devices={devices}, num_nodes={num_nodes}) does not match the launch: torchrun "
            f"started {per_node} processes per node (LOCAL_WORLD_SIZE={per_node}) of {world} in all (WORLD_SIZE={world}). "
            f"Set devices={per_node} and {nodes} (or torchrun --nproc-per-node {devices} --nnodes {num_nodes}): "
            "the strategy's node layout and default sharding_group_size come from devices."
        )
    local_rank, node_rank = environment.local_rank(), environment.node_rank()
    if local_rank >= devices or node_rank >= num_nodes:
        raise ValueError(
            f"TwoDRecStrategy: this process has local rank {local_rank} on node {node_rank}, but Trainer(devices={devices}, "
            f"num_nodes={num_nodes}) allows local ranks 0..{devices - 1} and nodes 0..{num_nodes - 1}. Set devices to the "
            "processes the launcher starts per node and num_nodes to the number of nodes."
        )


def _types_any_table_may_use(planning: PlanningConfig, table_names: Sequence[str]) -> Optional[list[str]]:
    """The sharding types some table may get (None: any): every table constrained to data_parallel makes
    the model all data-parallel, which CPU-only optimizer rules allow, whatever the global allow-list."""
    allowed = planning.sharding_types
    if not table_names:
        return allowed
    union: set[str] = set()
    for name in table_names:
        constraint = planning.table_constraints.get(name)
        own = constraint.sharding_types if constraint is not None and constraint.sharding_types else None
        if own is None and allowed is None:
            return None
        union.update(t for t in (own or allowed or []) if allowed is None or t in allowed)
    return sorted(union)


def check_trainer_settings(trainer: Trainer, precision: Precision, checkpoint_io: CheckpointIO) -> None:
    """Raise on Trainer settings the fused embedding update cannot honour; warn on those it honours in part."""
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
    for callback in getattr(trainer, "callbacks", []):
        # It sets trainer.accumulate_grad_batches at each epoch's start, after the check above ran.
        if isinstance(callback, GradientAccumulationScheduler) and any(f != 1 for f in callback.scheduling.values()):
            raise ValueError(
                f"GradientAccumulationScheduler(scheduling={callback.scheduling}) is not supported: the fused embedding "
                "optimizer updates the tables in every backward pass, so only the dense layers would accumulate. "
                "Remove the callback (or schedule 1 for every epoch) and use a larger batch instead."
            )
    if not isinstance(checkpoint_io, DCPCheckpointIO):
        raise ValueError(
            f"TwoDRecStrategy needs checkpoint_io=DCPCheckpointIO (the default); got "
            f"{type(checkpoint_io).__name__}, which would save only rank 0's shards."
        )
