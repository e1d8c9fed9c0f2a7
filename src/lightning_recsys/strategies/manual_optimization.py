"""Manual optimization under TwoDRecStrategy: the DDP inside DistributedModelParallel, prepared as Lightning's DDPStrategy prepares its own."""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.overrides.distributed import prepare_for_backward
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override


class ManualOptimizationHooks:
    """``pre_backward``/``post_backward`` for modules with ``automatic_optimization=False``."""

    _setup: Any
    lightning_module: Optional[LightningModule]
    sharded_model: Any

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        # Manual optimization runs backward inside DDP's forward (Lightning redirects training_step
        # through the wrapper), before DDP's post-forward prepared its reducer: without this the dense
        # gradients were never all-reduced and every rank stepped its own (as Lightning's DDPStrategy does).
        ddp = self._manual_dense_ddp()
        if ddp is not None:
            prepare_for_backward(ddp, closure_loss)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        # DMP's DDP has a static graph: its first backward must flush the delayed all-reduce, which
        # DDP queues from its output hook, and that hook is not reached when backward runs in forward.
        ddp = self._manual_dense_ddp()
        if ddp is not None and ddp.static_graph and not ddp._static_graph_delay_allreduce_enqueued:
            ddp.reducer._delay_all_reduce()
            ddp._static_graph_delay_allreduce_enqueued = True

    def _manual_dense_ddp(self) -> Optional[DistributedDataParallel]:
        """The dense DDP when the module optimizes manually (under automatic optimization backward runs after DDP's forward)."""
        if self._setup is None or self.lightning_module is None or self.lightning_module.automatic_optimization:
            return None
        return self.sharded_model.dense_ddp


class DenseDDPForwardRedirection(_ForwardRedirection):
    """Lightning's DDP forward redirection, for the DDP inside DistributedModelParallel.

    Under manual optimization the step's backward already ran inside the forward; DDP's post-forward
    must not prepare its reducer for another backward, or the next forward fails ("initialize_buckets
    must NOT be called during autograd execution"). ``pre_backward`` prepares it instead.
    """

    def __init__(self, strategy: ManualOptimizationHooks) -> None:
        self._strategy = strategy

    @override
    def on_after_inner_forward(self, wrapper_module: Module, original_module: LightningModule) -> None:
        ddp = self._strategy._manual_dense_ddp()
        if ddp is not None:
            ddp.require_backward_grad_sync = False

    @override
    def on_after_outer_forward(self, wrapper_module: Module, original_module: LightningModule) -> None:
        ddp = self._strategy._manual_dense_ddp()
        if ddp is not None:
            ddp.require_backward_grad_sync = True
