"""Hooks on the looked-up embeddings: non-finite checks, and gradient unscaling for fp16 loss scaling."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

NONFINITE_LOSS = "the training loss"
NONFINITE_EMBEDDINGS = "looked-up embeddings"
NONFINITE_GRADIENTS = "embedding gradients (the update FBGEMM applied in backward)"


class EmbeddingOutputHooks:
    """Forward hooks on the sharded embedding modules, for what must see every looked-up vector.

    * ``check_finite``: records (per kind, by module) non-finite looked-up embeddings and gradients;
      the caller decides, with every rank, what to do (``take_nonfinite``).
    * ``grad_scale``: a callable returning the loss scale (a tensor, so no host sync) when fp16
      training scales the loss. FBGEMM updates the tables inside backward, before the scaler could
      unscale, so the gradient reaching the tables is divided by the scale here; its non-finite
      entries (an overflowed step, which the scaler skips for the dense part) become 0, so that step
      leaves the looked-up rows as they were.

    Reading the output waits on TorchRec's lazy awaitable, so hooks are installed only when needed.
    """

    def __init__(self, *, check_finite: bool, grad_scale: Callable[[], Tensor] | None) -> None:
        self._check_finite = check_finite
        self._grad_scale = grad_scale
        self.nonfinite: dict[str, list[str]] = {NONFINITE_LOSS: [], NONFINITE_EMBEDDINGS: [], NONFINITE_GRADIENTS: []}
        self._handles: list[Any] = []

    @property
    def checks_finite(self) -> bool:
        return self._check_finite

    @property
    def needed(self) -> bool:
        return self._check_finite or self._grad_scale is not None

    def install(self, modules: dict[str, nn.Module]) -> None:
        for fqn, module in modules.items():
            self._handles.append(module.register_forward_hook(self._output_hook(fqn)))

    def remove(self) -> None:
        """Take the hooks off the modules (a later strategy may install its own on the same model)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def note_loss(self, loss: Any) -> None:
        if self._check_finite and isinstance(loss, Tensor) and not bool(torch.isfinite(loss.detach()).all()):
            self.nonfinite[NONFINITE_LOSS].append("loss")

    def take_nonfinite(self) -> dict[str, list[str]]:
        """What was recorded since the last call, by kind (sorted, unique), and clear it."""
        taken = {kind: sorted(set(where)) for kind, where in self.nonfinite.items()}
        for where in self.nonfinite.values():
            where.clear()
        return taken

    def _output_hook(self, fqn: str) -> Callable[..., None]:
        def on_output(module: nn.Module, inputs: Any, output: Any) -> None:
            pooled = output.values()
            for tensor in [pooled] if isinstance(pooled, Tensor) else [jagged.values() for jagged in pooled]:
                if self._check_finite and not bool(torch.isfinite(tensor.detach()).all()):
                    self.nonfinite[NONFINITE_EMBEDDINGS].append(fqn)
                if not tensor.requires_grad:
                    continue
                if self._grad_scale is not None:
                    tensor.register_hook(self._unscale)
                if self._check_finite:
                    tensor.register_hook(lambda grad: self._note_grad(fqn, grad))

        return on_output

    def _unscale(self, grad: Tensor) -> Tensor:
        assert self._grad_scale is not None
        unscaled = grad / self._grad_scale().to(grad.dtype)
        return torch.where(torch.isfinite(unscaled), unscaled, torch.zeros_like(unscaled))

    def _note_grad(self, fqn: str, grad: Tensor) -> None:
        if not bool(torch.isfinite(grad).all()):
            self.nonfinite[NONFINITE_GRADIENTS].append(fqn)
