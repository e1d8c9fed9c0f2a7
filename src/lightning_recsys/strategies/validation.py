"""Checks the strategy makes before it builds anything: what the device, the Trainer and the plugins allow."""

from __future__ import annotations

from typing import Optional

from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_recsys.parallel import EmbeddingOptimizerConfig
from lightning_recsys.parallel.sharders import validate_sharding_types
from lightning_recsys.planner import PlanningConfig
from lightning_recsys.strategies.checkpoint_io import DCPCheckpointIO


def check_device_support(
    device_type: str, backend: Optional[str], embedding_optimizer: EmbeddingOptimizerConfig, planning: PlanningConfig, *, two_d: bool
) -> None:
    """Raise if the device, backend, optimizer or allowed sharding types cannot run together."""
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"TwoDRecStrategy runs on accelerator 'cpu' or 'cuda', not {device_type!r}.")
    if device_type == "cpu" and backend == "nccl":
        raise ValueError("process_group_backend='nccl' needs CUDA devices; use 'gloo' (or None) with accelerator='cpu'.")
    allowed = planning.sharding_types
    embedding_optimizer.check_device(device_type, allowed)
    if allowed is not None:
        validate_sharding_types(allowed, device_type, "PlanningConfig(sharding_types)", two_d=two_d)
    for table, constraints in planning.table_constraints.items():
        argument = f"table_constraints[{table!r}].sharding_types"
        validate_sharding_types(constraints.sharding_types or [], device_type, argument, two_d=two_d)


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
