"""The embedding tables' learning rate, moved by a factor (an LR schedule) after the optimizers exist."""

from __future__ import annotations

from torch.optim import Optimizer
from torchrec.optim.keyed import KeyedOptimizer


class EmbeddingLearningRate:
    """Sets every table's learning rate to ``base_lr * factor``.

    Model-parallel tables are updated by FBGEMM inside backward, with the rate TorchRec's fused
    optimizer hands it: TorchRec's ``EmbeddingFusedOptimizer.step``/``zero_grad`` call FBGEMM's
    ``set_learning_rate(param_groups[0]["lr"])`` (torchrec ``distributed/batched_embedding_kernel.py``),
    so the new rate is written to the param groups and then applied with ``step()``, which updates
    nothing else. Data-parallel tables' torch optimizer gets the same rate.
    """

    def __init__(self, base_lr: float, fused_optimizer: KeyedOptimizer, data_parallel_optimizer: Optimizer | None) -> None:
        self.base_lr = base_lr
        self._fused = fused_optimizer
        self._data_parallel = data_parallel_optimizer
        self.factor = 1.0
        # The fused tables may hold another rate: a sharded module an earlier Trainer fitted keeps the last
        # one its schedule set. Start every fit at base_lr, or a first factor of 1.0 would never be applied.
        self._apply()

    @property
    def lr(self) -> float:
        return self.base_lr * self.factor

    def set_factor(self, factor: float) -> None:
        if not factor >= 0:
            raise ValueError(f"learning-rate factor {factor!r} must be >= 0 (the scheduler's lr / initial_lr).")
        if factor == self.factor:
            return
        self.factor = factor
        self._apply()

    def _apply(self) -> None:
        for group in self._fused.param_groups:
            group["lr"] = self.lr  # type: ignore[index]
        self._fused.step()  # applies the param groups' lr to FBGEMM; the tables were updated in backward
        for group in self._data_parallel.param_groups if self._data_parallel is not None else ():
            group["lr"] = self.lr

    def fused_lrs(self) -> list[float]:
        """The learning rate each fused FBGEMM module will use in the next backward."""
        return [float(group["lr"]) for group in self._fused.param_groups]
