"""The optimizer of the embedding tables: one config, mapped onto FBGEMM's fused kernels and torch."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

try:  # where fbgemm_gpu 1.8 keeps it; older releases had it in split_embedding_configs
    from fbgemm_gpu.tbe.config import WeightDecayMode
except ImportError:  # pragma: no cover
    from fbgemm_gpu.split_embedding_configs import WeightDecayMode  # type: ignore[no-redef,attr-defined]

log = logging.getLogger(__name__)

EmbeddingOptimizerName = Literal["sgd", "rowwise_adagrad", "adagrad", "adam"]

_FUSED_TYPES: dict[str, EmbOptimType] = {
    "sgd": EmbOptimType.EXACT_SGD,
    "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    "adagrad": EmbOptimType.EXACT_ADAGRAD,
    "adam": EmbOptimType.ADAM,
}

# FBGEMM's CPU TBE asserts "Optimizer adam is not supported in CPU mode" (fbgemm-gpu-cpu 1.8.0).
_CPU_UNSUPPORTED: frozenset[str] = frozenset({"adam"})

# Why each optimizer but rowwise_adagrad cannot follow the weight-decay rule (FBGEMM's kernel
# templates, fbgemm_gpu codegen/genscript/optimizers.py): only EXACT_ROWWISE_ADAGRAD has L2.
_NO_L2_DECAY: dict[str, str] = {
    "sgd": "FBGEMM's fused EXACT_SGD kernel has no weight decay",
    "adagrad": "FBGEMM's fused EXACT_ADAGRAD kernel has no weight decay",
    "adam": "FBGEMM's fused ADAM kernel only has decoupled decay, which torch's Adam for data-parallel tables does not match",
}


@dataclass(kw_only=True)
class EmbeddingOptimizerConfig:
    """Optimizer applied to the embedding tables.

    Model-parallel tables (table/row/column-wise) are updated inside the backward pass by FBGEMM's
    fused kernels; data-parallel tables get the equivalent torch optimizer, stepped with the dense one.

    Weight decay follows one rule for every table, whatever its sharding type: FBGEMM's L2 decay
    (``WeightDecayMode.L2``) on the rows looked up in the step. Such a row's gradient becomes
    ``g + weight_decay * w``, which also enters row-wise Adagrad's accumulator; rows not looked up
    neither decay nor change their accumulator. Data-parallel tables apply the same update in
    torch (``LookedUpRowWiseAdagrad``), reading "looked up" off the all-reduced gradient: a row
    whose gradient is exactly zero counts as not looked up. Only ``rowwise_adagrad`` has L2 decay
    in FBGEMM, so ``weight_decay > 0`` with another optimizer is refused; so is ``weight_decay > 0``
    on CPU where tables may be model-parallel, when FBGEMM's CPU kernel ignores the decay (as
    fbgemm-gpu-cpu 1.8.0 does; see ``check_device``).

    Args:
        name: one of ``sgd``, ``rowwise_adagrad``, ``adagrad``, ``adam``.
        lr: learning rate, > 0.
        eps: epsilon of Adagrad/Adam, > 0.
        weight_decay: L2 weight decay on the looked-up rows, >= 0; > 0 needs ``rowwise_adagrad``.
        beta1: Adam's first-moment decay, in [0, 1).
        beta2: Adam's second-moment decay, in [0, 1).
        lr_follows_scheduler: the tables' learning rate follows the first LR scheduler: ``lr`` times
            that scheduler's factor (its optimizer's current lr over its ``initial_lr``; for a
            scheduler that sets none, such as ``ReduceLROnPlateau``, over the lr it started from),
            set before every training step. Off by default: schedulers then move only the dense optimizers.
    """

    name: EmbeddingOptimizerName = "rowwise_adagrad"
    lr: float = 0.05
    eps: float = 1e-8
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    lr_follows_scheduler: bool = False

    def __post_init__(self) -> None:
        if self.name not in _FUSED_TYPES:
            raise ValueError(
                f"EmbeddingOptimizerConfig(name={self.name!r}) is not supported; choose one of {sorted(_FUSED_TYPES)}."
            )
        if not self.lr > 0:
            raise ValueError(f"EmbeddingOptimizerConfig(lr={self.lr}) must be > 0.")
        if not self.eps > 0:
            raise ValueError(f"EmbeddingOptimizerConfig(eps={self.eps}) must be > 0.")
        if self.weight_decay < 0:
            raise ValueError(f"EmbeddingOptimizerConfig(weight_decay={self.weight_decay}) must be >= 0.")
        if self.weight_decay > 0 and self.name in _NO_L2_DECAY:
            raise ValueError(
                f"EmbeddingOptimizerConfig(name={self.name!r}, weight_decay={self.weight_decay}) is not supported: "
                f"{_NO_L2_DECAY[self.name]}, so model-parallel and data-parallel tables would decay differently. "
                "Use name='rowwise_adagrad' (L2 decay on the looked-up rows of every table), or weight_decay=0."
            )
        if not isinstance(self.lr_follows_scheduler, bool):
            raise ValueError(f"EmbeddingOptimizerConfig(lr_follows_scheduler={self.lr_follows_scheduler!r}) must be a bool.")
        for field, value in (("beta1", self.beta1), ("beta2", self.beta2)):
            if not 0 <= value < 1:
                raise ValueError(f"EmbeddingOptimizerConfig({field}={value}) must be in [0, 1).")

    @property
    def is_adaptive(self) -> bool:
        """Whether each row's step is normalized by its gradients' history (every optimizer but SGD)."""
        return self.name != "sgd"

    def check_device(self, device_type: str, sharding_types: list[str] | None) -> None:
        """Raise if FBGEMM cannot run this optimizer for the tables that may be model-parallel."""
        model_parallel_possible = sharding_types is None or any(t != "data_parallel" for t in sharding_types)
        if device_type == "cpu" and self.name in _CPU_UNSUPPORTED and model_parallel_possible:
            raise ValueError(
                f"EmbeddingOptimizerConfig(name={self.name!r}) is not supported by FBGEMM's fused CPU kernels. "
                f"On CPU use one of {sorted(set(_FUSED_TYPES) - _CPU_UNSUPPORTED)}, or make every table data_parallel "
                "(PlanningConfig(sharding_types=['data_parallel']) or a TableConstraints per table); on CUDA every optimizer works."
            )
        if device_type == "cpu" and self.weight_decay > 0 and model_parallel_possible and not fbgemm_cpu_applies_l2_decay():
            raise ValueError(
                f"EmbeddingOptimizerConfig(weight_decay={self.weight_decay}) would be ignored on CPU: this FBGEMM's CPU "
                "rowwise_adagrad kernel does not apply weight_decay (measured at startup), so model-parallel tables "
                "would not decay. On CPU set weight_decay=0, or make every table data_parallel (PlanningConfig(sharding_types="
                "['data_parallel']) or a TableConstraints per table); on CUDA the decay works."
            )

    def fused_params(self) -> dict[str, Any]:
        """Keyword arguments for TorchRec sharders (``fused_params``), i.e. FBGEMM's TBE optimizer."""
        params: dict[str, Any] = {
            "optimizer": _FUSED_TYPES[self.name],
            "learning_rate": self.lr,
            "eps": self.eps,
        }
        if self.weight_decay > 0:  # without the mode FBGEMM's default, NONE, drops the decay
            params.update(weight_decay=self.weight_decay, weight_decay_mode=WeightDecayMode.L2)
        if self.name == "adam":
            params.update(beta1=self.beta1, beta2=self.beta2)
        return params

    def make_torch_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The same update rule as a torch optimizer, for data-parallel tables that FBGEMM does not fuse."""
        # weight_decay > 0 only reaches here with rowwise_adagrad (__post_init__).
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr)
        if self.name == "rowwise_adagrad":
            return LookedUpRowWiseAdagrad(params, lr=self.lr, eps=self.eps, weight_decay=self.weight_decay)
        if self.name == "adagrad":
            return torch.optim.Adagrad(params, lr=self.lr, eps=self.eps)
        return torch.optim.Adam(params, lr=self.lr, betas=(self.beta1, self.beta2), eps=self.eps)


class LookedUpRowWiseAdagrad(RowWiseAdagrad):
    """TorchRec's ``RowWiseAdagrad`` with FBGEMM's L2 rule: only looked-up rows decay.

    For each row looked up in the step, as FBGEMM's EXACT_ROWWISE_ADAGRAD with ``WeightDecayMode.L2``:
    ``g' = g + weight_decay * w``; ``sum += mean(g'^2)``; ``w -= lr * g' / (sqrt(sum) + eps)``.
    Other rows keep their weights and accumulator. TorchRec's own ``RowWiseAdagrad`` decays every
    row, so an untouched row would shrink and grow its accumulator each step. A data-parallel
    table's gradient is dense: a row counts as looked up when its gradient row is not all zero.
    State (``sum [rows, 1]``, ``step``) is the same as ``RowWiseAdagrad``'s, so checkpoints load either way.
    """

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            decay, eps = group["weight_decay"], group["eps"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                state["step"] += 1
                lr = group["lr"] / (1 + (state["step"].item() - 1) * group["lr_decay"])
                grad = -param.grad if group["maximize"] else param.grad
                if decay:
                    looked_up = grad.ne(0).any(dim=1, keepdim=True)
                    grad = torch.where(looked_up, grad + decay * param, grad)
                state["sum"] += grad.pow(2).mean(dim=1, keepdim=True)
                param.addcdiv_(grad, state["sum"].sqrt().add_(eps), value=-lr)
        return loss


@functools.cache
def fbgemm_cpu_applies_l2_decay() -> bool:
    """Whether FBGEMM's CPU rowwise-Adagrad kernel applies ``WeightDecayMode.L2`` (one tiny update, once).

    fbgemm-gpu-cpu 1.8.0's kernel accepts ``weight_decay`` and ``weight_decay_mode`` and ignores
    both; its CUDA kernel applies them. A probe, not a version check, so a fixed release is used.
    """
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    def one_update(decay: float) -> float:
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(1, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            learning_rate=1.0, eps=1.0, weight_decay=decay, weight_decay_mode=WeightDecayMode.L2,
        )
        with torch.no_grad():
            tbe.split_embedding_weights()[0].fill_(1.0)
        tbe(torch.tensor([0]), torch.tensor([0, 1])).sum().backward()
        return float(tbe.split_embedding_weights()[0][0, 0])

    try:
        applied = one_update(1.0) != one_update(0.0)
    except Exception:  # noqa: BLE001 - a probe that cannot run proves nothing: assume the decay is lost
        log.debug("FBGEMM weight-decay probe failed", exc_info=True)
        applied = False
    return applied
