"""The optimizer of the embedding tables: one config, mapped onto FBGEMM's fused kernels and torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

EmbeddingOptimizerName = Literal["sgd", "rowwise_adagrad", "adagrad", "adam"]

_FUSED_TYPES: dict[str, EmbOptimType] = {
    "sgd": EmbOptimType.EXACT_SGD,
    "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    "adagrad": EmbOptimType.EXACT_ADAGRAD,
    "adam": EmbOptimType.ADAM,
}

# FBGEMM's CPU TBE asserts "Optimizer adam is not supported in CPU mode" (fbgemm-gpu-cpu 1.8.0).
_CPU_UNSUPPORTED: frozenset[str] = frozenset({"adam"})


@dataclass(kw_only=True)
class EmbeddingOptimizerConfig:
    """Optimizer applied to the embedding tables.

    Model-parallel tables (table/row/column-wise) are updated inside the backward pass by FBGEMM's
    fused kernels; data-parallel tables get the equivalent torch optimizer, stepped with the dense one.

    Args:
        name: one of ``sgd``, ``rowwise_adagrad``, ``adagrad``, ``adam``.
        lr: learning rate, > 0.
        eps: epsilon of Adagrad/Adam, > 0.
        weight_decay: L2 weight decay, >= 0.
        beta1: Adam's first-moment decay, in [0, 1).
        beta2: Adam's second-moment decay, in [0, 1).
    """

    name: EmbeddingOptimizerName = "rowwise_adagrad"
    lr: float = 0.05
    eps: float = 1e-8
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999

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
        for field, value in (("beta1", self.beta1), ("beta2", self.beta2)):
            if not 0 <= value < 1:
                raise ValueError(f"EmbeddingOptimizerConfig({field}={value}) must be in [0, 1).")

    def check_device(self, device_type: str, sharding_types: list[str] | None) -> None:
        """Raise if FBGEMM cannot run this optimizer for the tables that may be model-parallel."""
        model_parallel_possible = sharding_types is None or any(t != "data_parallel" for t in sharding_types)
        if device_type == "cpu" and self.name in _CPU_UNSUPPORTED and model_parallel_possible:
            raise ValueError(
                f"EmbeddingOptimizerConfig(name={self.name!r}) is not supported by FBGEMM's fused CPU kernels. "
                f"On CPU use one of {sorted(set(_FUSED_TYPES) - _CPU_UNSUPPORTED)}, or restrict "
                "sharding_types to ['data_parallel']; on CUDA every optimizer works."
            )

    def fused_params(self) -> dict[str, Any]:
        """Keyword arguments for TorchRec sharders (``fused_params``), i.e. FBGEMM's TBE optimizer."""
        params: dict[str, Any] = {
            "optimizer": _FUSED_TYPES[self.name],
            "learning_rate": self.lr,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
        }
        if self.name == "adam":
            params.update(beta1=self.beta1, beta2=self.beta2)
        return params

    def make_torch_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The same update rule as a torch optimizer, for data-parallel tables that FBGEMM does not fuse."""
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, weight_decay=self.weight_decay)
        if self.name == "rowwise_adagrad":
            return RowWiseAdagrad(params, lr=self.lr, eps=self.eps, weight_decay=self.weight_decay)
        if self.name == "adagrad":
            return torch.optim.Adagrad(params, lr=self.lr, eps=self.eps, weight_decay=self.weight_decay)
        return torch.optim.Adam(
            params, lr=self.lr, betas=(self.beta1, self.beta2), eps=self.eps, weight_decay=self.weight_decay
        )
