"""The ``torch.profiler`` labels of a training step's phases: one table, used by the code, the tests and the docs.

Every phase carries a ``record_function`` range under a stable name (``STEP_PHASES``), so a trace from
``Trainer(profiler="pytorch")`` (or ``torch.profiler.profile`` around ``fit``) shows where a step's time
goes. TorchRec's own ranges (``## All2All_Pooled_fwd ##``, ``## KJTAllToAllSplitsAwaitable wait() ##``, ...)
stay in the trace beside ours; ours name the phase whatever the sharding type or collective does it.

No range is opened unless a profiler is recording (``profiling()``), and nothing is done per row: a
step without a profiler pays one flag check per phase. The module hooks (``StepPhaseLabels``) are on
the model only while a profiler records: ``follow_profiler()``, called once per training step,
installs them when one starts and removes them when it stops, since hooks take every call of a
module off ``nn.Module``'s fast path (no hooks: ``_call_impl`` calls ``forward`` directly).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torchrec.distributed.types import Awaitable

from lightning_recsys.contracts.phases import profiling, step_phase

INPUT_DIST = "recsys:input_dist"
LOOKUP = "recsys:lookup"
EMBEDDING_ALL_TO_ALL_FORWARD = "recsys:embedding_all_to_all_fwd"
EMBEDDING_ALL_TO_ALL_BACKWARD = "recsys:embedding_all_to_all_bwd"
REPLICA_SYNC_LAUNCH = "recsys:replica_sync_launch"
REPLICA_SYNC_EXCHANGE = "recsys:replica_sync_exchange"
REPLICA_SYNC_APPLY = "recsys:replica_sync_apply"
DENSE_ALL_REDUCE = "recsys:dense_all_reduce"
BATCH_HANDSHAKE = "recsys:batch_handshake"

# label -> what its range covers (the docs' table is this one).
STEP_PHASES: dict[str, str] = {
    INPUT_DIST: "the sparse features' input distribution: starting it and waiting for it (KJT splits and ids "
    "all-to-all); with the sparse-dist pipeline also where the next batch's is started and its ids sent",
    LOOKUP: "the embedding lookup of each sharded module's TorchRec lookups (FBGEMM kernels)",
    EMBEDDING_ALL_TO_ALL_FORWARD: "the embedding output distribution, forward: launching it and waiting for its result",
    EMBEDDING_ALL_TO_ALL_BACKWARD: "the embedding output distribution's backward: from the gradient reaching its "
    "output to the gradient reaching the lookup",
    REPLICA_SYNC_LAUNCH: "2D: starting a replica sync (the union of touched rows, the collectives' launch; all of a "
    "blocking sync's exchange)",
    REPLICA_SYNC_EXCHANGE: "2D, overlapped: the next piece of a sync in flight, sent at a step's end",
    REPLICA_SYNC_APPLY: "2D: waiting for a sync's collectives and writing the averaged rows",
    DENSE_ALL_REDUCE: "DDP's gradient all-reduce, launched per bucket from its comm hook during backward",
    BATCH_HANDSHAKE: "the per-batch agreement between ranks (input check results, skip and stop requests)",
}


class _Range:
    """A range opened in one hook and closed in another (forward pre- and post-hooks, two autograd nodes)."""

    def __init__(self) -> None:
        self._open: Any = None

    def open(self, label: str) -> None:
        self.close()
        self._open = torch.autograd.profiler.record_function(label)
        self._open.__enter__()

    def close(self) -> None:
        if self._open is not None:
            opened, self._open = self._open, None
            opened.__exit__(None, None, None)


class _OpenOnBackward(torch.autograd.Function):
    """Identity; its backward (the gradient reaching the all-to-all's output) opens the backward range."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, span: _Range) -> Tensor:  # type: ignore[override]
        ctx.span = span
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        ctx.span.open(EMBEDDING_ALL_TO_ALL_BACKWARD)
        return grad, None


class _CloseOnBackward(torch.autograd.Function):
    """Identity; its backward (the gradient reaching the lookup's output) closes the backward range."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, span: _Range) -> Tensor:  # type: ignore[override]
        ctx.span = span
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        ctx.span.close()
        return grad, None


class _LabelledWait(Awaitable[Tensor]):
    """The output distribution's awaitable, its wait labelled and its result marked for the backward range."""

    def __init__(self, inner: Awaitable[Tensor], span: _Range | None) -> None:
        super().__init__()
        self._inner, self._span = inner, span

    def _wait_impl(self) -> Tensor:
        with step_phase(EMBEDDING_ALL_TO_ALL_FORWARD):
            result = self._inner.wait()
        if self._span is not None and isinstance(result, Tensor) and result.requires_grad:
            result = _OpenOnBackward.apply(result, self._span)
        return result


class StepPhaseLabels:
    """Forward hooks on TorchRec's sharded embedding modules that label input distribution, lookup and the
    embedding all-to-all (forward and backward)."""

    def __init__(self, sharded_modules: list[nn.Module] | None = None) -> None:
        self._modules = list(sharded_modules or [])
        self._handles: list[Any] = []

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def follow_profiler(self) -> None:
        """Hook the modules while a profiler records, unhook them when none does (once per step)."""
        if profiling() and not self._handles:
            self.install(self._modules)
        elif not profiling() and self._handles:
            self.remove()

    def install(self, sharded_modules: list[nn.Module]) -> None:
        """Hook every module with TorchRec's ``_lookups`` and ``_output_dists`` (ShardedEmbedding(Bag)Collection)."""
        for module in sharded_modules:
            lookups, dists = list(getattr(module, "_lookups", [])), list(getattr(module, "_output_dists", []))
            if not lookups:
                continue
            state = _ModuleState()
            self._handles.append(module.register_forward_pre_hook(state.forward_starts))
            self._handles.append(module.register_forward_hook(state.forward_ends, always_call=True))
            for lookup in lookups:
                self._handles.append(lookup.register_forward_pre_hook(state.lookup_starts))
                self._handles.append(lookup.register_forward_hook(state.lookup_ends, always_call=True))
            for output_dist in dists:
                self._handles.append(output_dist.register_forward_pre_hook(state.dist_starts))
                self._handles.append(output_dist.register_forward_hook(state.dist_ends, always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class _ModuleState:
    """The ranges of one sharded module's forward: input distribution until the first lookup, then per
    lookup its lookup and its output distribution (TorchRec's ``compute_and_output_dist`` order)."""

    def __init__(self) -> None:
        self._forward = _Range()
        self._backward: list[_Range] = []  # one per lookup of the forward in progress

    def forward_starts(self, module: nn.Module, args: Any) -> None:
        self._backward = []
        if profiling():
            self._forward.open(INPUT_DIST)

    def forward_ends(self, module: nn.Module, args: Any, output: Any) -> None:
        self._forward.close()

    def lookup_starts(self, module: nn.Module, args: Any) -> None:
        self._forward.close()  # the input distribution ended with the first lookup
        if profiling():
            self._forward.open(LOOKUP)

    def lookup_ends(self, module: nn.Module, args: Any, output: Any) -> Any:
        self._forward.close()
        if not profiling() or not isinstance(output, Tensor) or not output.requires_grad:
            return None
        span = _Range()
        self._backward.append(span)
        return _CloseOnBackward.apply(output, span)

    def dist_starts(self, module: nn.Module, args: Any) -> None:
        if profiling():
            self._forward.open(EMBEDDING_ALL_TO_ALL_FORWARD)

    def dist_ends(self, module: nn.Module, args: Any, output: Any) -> Any:
        self._forward.close()
        if not profiling() or not isinstance(output, Awaitable):
            return None
        return _LabelledWait(output, self._backward.pop(0) if self._backward else None)
