"""Pipelined sparse input distribution: the next batch's KJT all-to-all runs while this batch computes.

What ``TrainPipelineSparseDist`` does for a hand-written loop, done from the batch iterator so the
training loop (Lightning's, or any other) stays a plain ``forward, backward, step``. TorchRec's own
pieces do the work: ``_rewrite_model`` fx-traces the model with a batch and swaps each sharded
module's ``forward`` for a ``PipelinedForward`` that consumes an input distribution started
earlier; ``_start_data_dist`` starts it (the splits all-to-all) and the fused splits awaitable,
waited after the forward of the step before, sends the ids. Per batch, in order:

1. ``start(batch)`` (after every rank agreed on the batch): copy to the device on a side stream
   (CUDA), then start its input distribution, on another stream;
2. when a pipelined module is called with that batch's tensors, it reads their distribution; the
   batch is found by its tensors, not by when it left the iterator, because a loop may fetch ahead
   (Lightning prefetches a batch from loaders without ``__len__``) or take turns between iterators;
3. after that step's forward (a forward hook on the model), the ids of the batch started next are sent.

``StagedTrainPipeline`` and ``SparseDataDistUtil`` do not fit here: the stage pipeline owns the
dataloader iterator (the batch handshake must decide skip/stop first), and the util's forward hook
runs after every forward of the model, evaluation included, against one global pair of contexts.
Here every started batch has its own context, so train and evaluation iterators can take turns.

A sharded module is called with the batch's own tensors or it is not pipelined: a module that
receives anything else (its input is computed in ``forward``, or changed after the batch left the
iterator) runs its ordinary forward on what it received, and the pipeline turns itself off with one
warning naming the module. Pipelining changes when the ids move, never what is computed.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.train_pipeline.pipeline_context import TrainPipelineContext
from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward
from torchrec.distributed.train_pipeline.utils import (
    _override_input_dist_forwards,
    _pipeline_detach_model,
    _rewrite_model,
    _start_data_dist,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_recsys.parallel.comms import comm_for_batch, discard_batch_comm, release_batch_comm
from lightning_recsys.parallel.step_phases import INPUT_DIST, step_phase

log = logging.getLogger(__name__)

PipelineMode = Literal["sparse_dist", "off"]
PIPELINE_MODES: tuple[str, ...] = ("sparse_dist", "off")


@dataclass
class _BatchContext(TrainPipelineContext):
    """TorchRec's per-batch pipeline context, plus the inputs each pipelined module must be called with."""

    expected_inputs: dict[str, tuple[list[Any], dict[str, Any]]] = field(default_factory=dict)
    splits_waited: bool = True
    account: bool = False  # its collectives count for the training step that consumes the batch
    token: object = field(default_factory=object)  # the accounting's key for this batch (contexts are unhashable)
    handshake_token: object = None  # the accounting's key for the batch handshakes issued up to this batch
    batch: Any = None
    consumed: bool = False  # a module has read it: its accounting is released and its copy waited for


@dataclass
class StartedBatch:
    """A batch (on the device) whose input distribution has started; ``context`` None: not pipelined."""

    batch: Any
    context: Optional[_BatchContext]


class SparseDistPipeline:
    """Pipelines the input distribution of one ``DistributedModelParallel``'s sharded modules.

    Lightning-free. ``start`` the batch after next's distribution, ``activate`` the batch about to
    run; ``close`` restores the model. Every rank must make the same calls in the same order.

    Args:
        dmp: the sharded model; its ``module`` is traced with the first batch.
        device: where the model runs; on CUDA the copy and the distribution get their own streams.
    """

    def __init__(self, dmp: nn.Module, device: torch.device) -> None:
        self._dmp = dmp
        self._device = device
        cuda = device.type == "cuda"
        self._memcpy_stream: Optional[torch.cuda.Stream] = torch.cuda.Stream(device, priority=-1) if cuda else None
        self._dist_stream: Optional[torch.cuda.Stream] = torch.cuda.Stream(device, priority=-1) if cuda else None
        self._modules: list[nn.Module] = []
        self._original_forwards: list[Callable[..., Any]] = []
        self._original_kjt_dist_forwards: list[Any] = []
        self._attached = False
        self._hook: Any = None
        self._next: Optional[_BatchContext] = None  # started, its ids not sent yet
        self._pending: list[_BatchContext] = []  # started, some module has not read it yet; oldest first
        self._index = 0
        self.disabled_reason: Optional[str] = None

    @property
    def enabled(self) -> bool:
        return self.disabled_reason is None

    @property
    def pipelined_modules(self) -> list[str]:
        return [m.forward.name for m in self._modules]  # type: ignore[union-attr]

    # ----------------------------------------------------------------- per batch
    def start(self, batch: Any, *, account: bool = False, handshake_token: object = None) -> StartedBatch:
        """Copy ``batch`` to the device and start its input distribution (unless the pipeline is off).

        ``account``: its collectives are filed under the training step that runs the batch, and so
        are those held under ``handshake_token`` (released when a module reads the batch).
        """
        batch = self._to_device(batch)
        if not self.enabled or (not self._attached and not self._attach(batch)):
            _settle(handshake_token, account)
            return StartedBatch(batch, None)
        first = not self._original_kjt_dist_forwards
        expected_inputs = self._expected_inputs(batch, first=first)
        if expected_inputs is None:  # the first batch: nothing started, the model has its forwards back
            _settle(handshake_token, account)
            return StartedBatch(batch, None)
        self._send_pending()  # an earlier batch whose step never ran a forward (another loop took over)
        context = _BatchContext(index=self._index, version=1, account=account, handshake_token=handshake_token, batch=batch)
        context.expected_inputs = expected_inputs
        self._index += 1
        with self._stream(self._dist_stream), comm_for_batch(context.token if account else None), step_phase(INPUT_DIST):
            if self._memcpy_stream is not None:
                torch.cuda.current_stream(self._device).wait_stream(self._memcpy_stream)
            _start_data_dist(self._modules, batch, context)
            if first:  # TorchRec's input dists exist only after their first call; then fuse their splits
                self._original_kjt_dist_forwards = _override_input_dist_forwards(self._modules)
        context.splits_waited = False
        self._pending.append(context)
        if first:
            self._send_ids(context)
        else:
            self._next = context
        return StartedBatch(batch, context)

    def _expected_inputs(self, batch: Any, *, first: bool) -> Optional[dict[str, tuple[list[Any], dict[str, Any]]]]:
        """Each pipelined module's inputs, read from ``batch`` along the path the trace recorded.

        The trace follows one branch of ``forward`` (``isinstance(batch, dict)`` is False for fx's proxy),
        so that path may not exist in the real batch. On the first batch nothing has started yet: the
        pipeline turns itself off (None) and the model runs unpipelined. Later, TorchRec's input
        distributions are already replaced, so it raises, naming the module."""
        expected: dict[str, tuple[list[Any], dict[str, Any]]] = {}
        for module in self._modules:
            forward: PipelinedForward = module.forward  # type: ignore[assignment]
            try:
                expected[forward.name] = forward.args.build_args_kwargs(batch)
            except Exception as error:  # noqa: BLE001 - any step of the recorded path (attribute, item, call) may fail
                why = (
                    f"the input of sharded module {forward.name!r}, as fx tracing recorded it, cannot be read from the "
                    f"batch ({type(error).__name__}: {error}); forward probably branches on the batch's type or content"
                )
                if first:
                    self.close()
                    self._disable(why)
                    return None
                raise RuntimeError(f"TwoDRecStrategy(pipeline='sparse_dist'): {why}. Use pipeline='off' for this model.") from error
        return expected

    def consume(self, name: str, args: list[Any], kwargs: dict[str, Any]) -> Optional[_BatchContext]:
        """The started batch whose inputs for module ``name`` are these tensors, ready to read; None if none is."""
        for context in self._pending:
            expected = context.expected_inputs.get(name)
            if expected is not None and _same_inputs(expected, (args, kwargs)):
                self._ready(context)
                del context.expected_inputs[name]
                if not context.expected_inputs:
                    self._forget(context)
                return context
        return None

    def abandon(self, name: str) -> None:
        """Module ``name`` got unknown inputs and the step fails: finish its started collectives first."""
        for context in self._pending:
            request = context.input_dist_tensors_requests.pop(name, None)
            if request is not None:
                request.wait()  # every rank started it

    def _ready(self, context: _BatchContext) -> None:
        if context.consumed:
            return
        context.consumed = True
        _settle(context.handshake_token, context.account)
        if context.account:
            release_batch_comm(context.token)
        if self._memcpy_stream is not None:
            current = torch.cuda.current_stream(self._device)
            current.wait_stream(self._memcpy_stream)
            _record_stream(context.batch, current)
        if not context.splits_waited:  # no forward ran since it started: send its ids now
            if context is self._next:
                self._next = None
            self._send_ids(context)

    def drop(self, started: StartedBatch, *, wait: bool = True) -> None:
        """A started batch whose step will not run (the loop stopped): finish its collectives.

        ``wait=False`` (this rank failed alone; its peers are not at these collectives): forget them
        instead, neither sending the ids nor waiting, which would hang until the process-group timeout."""
        context = started.context
        if context is None or not any(c is context for c in self._pending):
            return
        self._forget(context)
        if context is self._next:
            self._next = None
        if not context.consumed:
            discard_batch_comm(context.handshake_token)
        if wait and not context.splits_waited:
            self._send_ids(context)
        for request in list(context.input_dist_tensors_requests.values()) if wait else []:
            try:
                request.wait()
            except (RuntimeError, dist.DistError) as error:  # the run is already ending or failing
                log.debug("in-flight input distribution failed while closing: %s", error)
        context.input_dist_tensors_requests.clear()
        context.module_contexts.clear()
        context.expected_inputs.clear()
        discard_batch_comm(context.token)

    def close(self, *, wait: bool = True) -> None:
        """Finish (``wait=False``: forget, see ``drop``) the started batches no step read, and give the
        sharded modules their own forwards back."""
        for context in list(self._pending):
            self.drop(StartedBatch(context.batch, context), wait=wait)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._attached and self._original_kjt_dist_forwards:
            _pipeline_detach_model(self._dmp, self._modules, self._original_forwards, self._original_kjt_dist_forwards, [])
        elif self._attached:  # detached before any distribution started; reversed: a repeated module was wrapped twice
            for module, original in reversed(list(zip(self._modules, self._original_forwards))):
                module.forward = original  # type: ignore[method-assign]
        self._attached = False
        self._modules, self._original_forwards, self._original_kjt_dist_forwards = [], [], []
        self._next = None
        self._pending = []

    # ----------------------------------------------------------------- internals
    def _forget(self, context: _BatchContext) -> None:
        # By identity: the dataclass's == (TrainPipelineContext's) would compare the contexts' fields.
        self._pending = [c for c in self._pending if c is not context]

    def _attach(self, batch: Any) -> bool:
        model = getattr(self._dmp, "module", self._dmp)
        name = type(model).__name__
        try:
            modules, _, originals, _, not_pipelined = _rewrite_model(
                model=self._dmp, context=_BatchContext(), dist_stream=self._dist_stream, batch=batch,
                pipelined_forward=_CheckedForward,
                default_stream=torch.cuda.current_stream(self._device) if self._dist_stream is not None else None,
            )
        except Exception as error:  # noqa: BLE001 - fx tracing fails in many ways; the run goes on unpipelined
            self._disable(f"TorchRec could not fx-trace {name}.forward with the batch ({type(error).__name__}: {error})")
            return False
        self._modules, self._original_forwards, self._attached = modules, originals, True
        for module, original in zip(modules, originals):
            module.forward._original = original  # type: ignore[union-attr]
            module.forward._pipeline = self  # type: ignore[union-attr]
        names = [m.forward.name for m in modules]  # type: ignore[union-attr]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated or not modules:
            self.close()
            why = f"{repeated} are called more than once per forward" if repeated else "none of them reads its input from the batch"
            self._disable(f"no sharded module of {name} can be pipelined: {why}")
            return False
        if not_pipelined:
            self._warn(
                f"sharded module(s) {not_pipelined} of {name} run without pipelining: TorchRec pipelines only inputs "
                "read directly from the batch (attributes or items), and theirs are computed in forward"
            )
        self._hook = self._dmp.register_forward_hook(self._after_forward)
        return True

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._send_pending()

    def _send_pending(self) -> None:
        if self._next is not None:
            context, self._next = self._next, None
            if not context.splits_waited:
                self._send_ids(context)

    def _send_ids(self, context: _BatchContext) -> None:
        """Wait for the splits all-to-all; that sends the ids (the second part of TorchRec's input dist)."""
        with self._stream(self._dist_stream), comm_for_batch(context.token if context.account else None), step_phase(INPUT_DIST):
            for names, awaitable in context.fused_splits_awaitables:
                for name, request in zip(names, awaitable.wait()):
                    context.input_dist_tensors_requests[name] = request
        context.input_dist_splits_requests.clear()
        context.fused_splits_awaitables.clear()
        context.splits_waited = True

    @staticmethod
    def unexpected_input_message(module_name: str) -> str:
        return (
            f"TwoDRecStrategy(pipeline='sparse_dist'): sharded module {module_name!r} was called with other inputs "
            "than the batch's own tensors whose distribution started (its input is changed between the dataloader "
            "and the module, e.g. in training_step or a batch-transfer hook). Use pipeline='off' for this model."
        )

    def _disable(self, reason: str) -> None:
        if self.disabled_reason is None:
            self.disabled_reason = reason
            self._warn(reason)

    def _warn(self, message: str) -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            warnings.warn(f"TwoDRecStrategy(pipeline='sparse_dist'): {message}; pipeline='off' avoids this.", stacklevel=3)

    def _stream(self, stream: Optional[torch.cuda.Stream]) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def _to_device(self, batch: Any) -> Any:
        if self._memcpy_stream is None:
            return batch  # CPU: the batch is where the model is; Lightning's transfer is a no-op
        with torch.cuda.stream(self._memcpy_stream):
            return _move(batch, self._device)


class _CheckedForward(PipelinedForward):
    """TorchRec's ``PipelinedForward``, used only when the module gets the tensors whose distribution started."""

    _original: Callable[..., Any]
    _pipeline: SparseDistPipeline

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        context = self._pipeline.consume(self._name, list(inputs), kwargs)
        if context is None:
            self._pipeline.abandon(self._name)
            # The original forward cannot run here: TorchRec's pipeline replaced the input dist's
            # KJTAllToAll forwards (_override_input_dist_forwards) for every module at once.
            raise RuntimeError(self._pipeline.unexpected_input_message(self._name))
        self.set_context(context)
        return super().__call__(*inputs, **kwargs)


def _same_inputs(expected: Any, actual: Any) -> bool:
    """The same tensors (a KeyedJaggedTensor may be a new wrapper of them, as ``.to(its device)`` makes)."""
    if expected is actual:
        return True
    if isinstance(expected, KeyedJaggedTensor) and isinstance(actual, KeyedJaggedTensor):
        pairs = [
            (expected.weights_or_none(), actual.weights_or_none()),
            (expected.lengths_or_none(), actual.lengths_or_none()),
            (expected.offsets_or_none(), actual.offsets_or_none()),
        ]
        return (
            expected.values() is actual.values()
            and expected.keys() == actual.keys()
            and all(a is None or b is None or a is b for a, b in pairs)  # a cache computed on one side only
            and (expected.weights_or_none() is None) == (actual.weights_or_none() is None)
        )
    if isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple)):
        return len(expected) == len(actual) and all(_same_inputs(a, b) for a, b in zip(expected, actual))
    if isinstance(expected, dict) and isinstance(actual, dict):
        return expected.keys() == actual.keys() and all(_same_inputs(expected[k], actual[k]) for k in expected)
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        return False
    try:
        return bool(expected == actual)
    except Exception:  # noqa: BLE001 - an object without a usable ==
        return False


def _move(batch: Any, device: torch.device) -> Any:
    """``batch`` on ``device`` (asynchronously where the memory is pinned), whatever its container."""
    if isinstance(batch, (torch.Tensor, KeyedJaggedTensor)) or callable(getattr(batch, "to", None)):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return type(batch)({k: _move(v, device) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(_move(v, device) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: _move(getattr(batch, f.name), device) for f in dataclasses.fields(batch) if f.init})
    return batch


def _record_stream(batch: Any, stream: torch.cuda.Stream) -> None:
    """Tell the caching allocator that ``stream`` uses the batch's memory (it was made on the copy stream)."""
    if isinstance(batch, torch.Tensor):
        batch.record_stream(stream)
    elif isinstance(batch, KeyedJaggedTensor):
        batch.record_stream(stream)
    elif isinstance(batch, dict):
        for value in batch.values():
            _record_stream(value, stream)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            _record_stream(value, stream)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for f in dataclasses.fields(batch):
            _record_stream(getattr(batch, f.name), stream)


def pipelined(
    agreed: Iterator[tuple[Any, object]], pipeline: SparseDistPipeline, *, account: Callable[[], bool]
) -> Iterator[Any]:
    """Yield ``agreed``'s batches with the next one's input distribution started before each is yielded.

    ``agreed`` yields ``(batch, token)`` for the batches every rank runs (the handshake's decisions);
    ``token`` holds the accounting of the handshakes issued up to it, released with its batch. An
    error ``agreed`` raises about the next batch surfaces after the current batch's step, as
    without the pipeline. ``account()``: whether the batches are a training loop's (their
    collectives then count for its steps).
    """
    current: Optional[StartedBatch] = None
    upcoming: Optional[StartedBatch] = None
    handed: list[StartedBatch] = []  # yielded; a loop that fetches ahead may not have run them yet
    try:
        first = next(agreed, _END)
        if first is _END:
            return
        current = pipeline.start(first[0], account=account(), handshake_token=first[1])
        while current is not None:
            error: Optional[BaseException] = None
            try:
                following = next(agreed, _END)
            except Exception as raised:  # noqa: BLE001 - re-raised after the current step, as without the pipeline
                following, error = _END, raised
            if following is not _END:
                upcoming = pipeline.start(following[0], account=account(), handshake_token=following[1])
            handed.append(current)
            del handed[:-_HANDED_KEPT]
            batch, current = current.batch, None
            yield batch
            if error is not None:
                raise error
            current, upcoming = upcoming, None
    except GeneratorExit:  # the loop stopped early: the batches it had fetched ahead never run
        for started in handed:
            pipeline.drop(started)
        raise
    finally:
        # Yielded batches stay startable when the source simply ends: a loop that fetches ahead
        # runs them after this generator is done (the pipeline drops leftovers when it closes).
        for started in (current, upcoming):
            if started is not None:
                pipeline.drop(started)
        close = getattr(agreed, "close", None)
        if close is not None:
            close()


def _settle(handshake_token: object, account: bool) -> None:
    """File the handshakes held under ``handshake_token`` under the current step, or drop them."""
    if handshake_token is not None:
        (release_batch_comm if account else discard_batch_comm)(handshake_token)


_END = object()
_HANDED_KEPT = 4  # yielded batches remembered for dropping; more than any loop fetches ahead
