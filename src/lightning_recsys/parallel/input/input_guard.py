"""Keeping the ranks' batches in step, and sharing each rank's input check (``batch_check``) with the others.

FBGEMM clamps an out-of-range id to row 0 and only logs it; a rank that runs out of batches (or
gets an empty one, which row-wise sharding cannot take) leaves the others waiting in an all-to-all.
Every rank therefore checks its batch, then all ranks exchange a few integers on a CPU (gloo)
group before the step: whether each has a batch, its size, and whether its input is valid. They
then act on the same facts: stop together, skip a step together, or raise the same error together.

A problem is *fatal* when no setting can make the step right (duplicate or missing keys, lengths
or weights that do not match the values, non-finite weights, a check that itself failed): it
raises on every rank even with ``validate_inputs="warn"``. Only out-of-range ids (which FBGEMM
clamps) and weights that an unweighted model ignores can be downgraded to a warning. A check never
raises on its own rank: whatever goes wrong becomes a problem every rank learns of in the handshake.
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchrec import KeyedJaggedTensor

from lightning_recsys.parallel.comms import comm_for_batch, comm_purpose, discard_batch_comm, release_batch_comm
from lightning_recsys.parallel.input.batch_check import InputProblem, InputValidator, InvalidInputError, ValidateInputs, find_kjts
from lightning_recsys.parallel.input.input_pipeline import SparseDistPipeline, pipelined
from lightning_recsys.parallel.input.loader_position import LoaderPosition, Progress, drop_first
from lightning_recsys.parallel.step_phases import BATCH_HANDSHAKE, step_phase
from lightning_recsys.parallel.topology import raised_on_every_rank

log = logging.getLogger(__name__)

_MAX_WARNINGS = 10


@dataclass(frozen=True)
class RankBatch:
    """What one rank tells the others about its next batch."""

    has_batch: bool
    size: int  # examples; -1 when the batch carries no KeyedJaggedTensor to count
    problems: int
    fatal: int  # how many of the problems no validate_inputs setting may downgrade
    stop: int = 0  # the rank was asked to stop, why as the caller's bit flags (SIGTERM, a requeue): every rank stops on this step


class CoordinatedBatches:
    """Wraps a rank's dataloader so that all ranks stop, skip or fail on the same step.

    * a rank runs out of batches: every rank stops there (the others' extra batches are dropped);
    * a rank's batch is empty, or sizes differ where the plan needs equal ones (row-wise's
      reduce-scatter): every rank skips that step;
    * invalid input on any rank: every rank raises ``InvalidInputError`` with all ranks' problems
      (``validate="error"``, or any fatal problem), or logs them and goes on (``"warn"``; FBGEMM
      then clamps);
    * the check, or the rank's dataloader, raises: that becomes a fatal problem of the rank, so
      every rank raises together (the rank whose loader raised re-raises its own exception).

    ``pipeline``: a ``SparseDistPipeline``; each agreed batch's input distribution then starts
    (after its check and handshake) before the batch ahead of it is yielded. ``training()`` says
    whether the batches feed training steps (their collectives are accounted to those steps).
    ``progress()``: the training loop's steps run in this epoch, and whether it counts the epoch as
    complete; with it, ``state_dict`` / ``load_state_dict`` resume a mid-epoch checkpoint at the next
    batch (``LoaderPosition``; a loader with its own ``state_dict`` keeps it instead).
    ``checked_before``: the caller's batch hooks that change a batch after this check (a Lightning
    module's ``on_before_batch_transfer``, ...); a report of bad input names them.
    ``stop_requested()``: whether, and why, this rank was asked to stop (non-zero bit flags of the
    caller's: its SIGTERM, a requeue signal); it rides in the handshake, and ``on_stop(ranks, requests)``
    (the ranks that asked, their flags or-ed) runs on every rank at the same step once any rank asked.
    """

    def __init__(
        self,
        loader: Iterable[Any],
        *,
        group: dist.ProcessGroup,
        validator: InputValidator | None,
        validate: ValidateInputs,
        equal_sizes_required: bool,
        pipeline: SparseDistPipeline | None = None,
        training: Callable[[], bool] = lambda: False,
        progress: Progress | None = None,
        stop_requested: Callable[[], int] = lambda: 0,
        on_stop: Callable[[list[int], int], None] = lambda ranks, requests: None,
        checked_before: tuple[str, ...] = (),
    ) -> None:
        self.loader = loader
        self._checked_before = checked_before
        self._stop_requested = stop_requested
        self._on_stop = on_stop
        self._position = LoaderPosition(progress)
        self.pipeline = pipeline
        self._training = training
        self._group = group
        self._validator = validator if validate != "off" else None
        self._validate = validate
        self._equal_sizes_required = equal_sizes_required
        self._warnings = 0
        self.dropped_batches = 0
        self.skipped_steps = 0

    def __len__(self) -> int:
        # An empty loader counts as one batch. Lightning decides on each rank alone what a loop of zero
        # batches does: it raised "within local rank has zero length" on that rank only, or (with
        # allow_zero_length_dataloader_with_multiple_devices) skipped the loop there while the other
        # ranks waited in the batch handshake until process_group_timeout. Counted as one, the loop runs
        # on every rank, and the first handshake stops every rank there, as for any uneven end.
        return max(1, len(self.loader))  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)  # sampler, dataset, batch_size, ... for Lightning

    def _loader_is_stateful(self) -> bool:
        return callable(getattr(self.loader, "state_dict", None)) and callable(getattr(self.loader, "load_state_dict", None))

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict() if self._loader_is_stateful() else self._position.state_dict()  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._loader_is_stateful():
            self.loader.load_state_dict(state)  # type: ignore[attr-defined]
        else:
            self._position.load_state_dict(state)

    def __iter__(self) -> Iterator[Any]:
        first_step, skip = (0, 0) if self._loader_is_stateful() else self._position.start()
        source = drop_first(iter(self.loader), skip, _END) if skip else iter(self.loader)
        agreed = self._agreed(source, tagged=True, first_step=first_step, skipped=skip)
        if self.pipeline is None or not self.pipeline.enabled:
            return self._settled(agreed)
        return pipelined(agreed, self.pipeline, account=self._training)

    def _settled(self, agreed: Generator[tuple[Any, object], None, None]) -> Iterator[Any]:
        """The batches, with the handshakes issued up to each one filed under the training step it feeds,
        or dropped when it feeds none (sanity check, validation, test, predict), as the pipeline does."""
        try:
            for batch, token in agreed:
                (release_batch_comm if self._training() else discard_batch_comm)(token)
                yield batch
        finally:
            agreed.close()  # a loop that stopped early: its handshake in flight completes now (see _agreed)

    def _agreed(self, iterator: Iterator[Any], *, tagged: bool, first_step: int = 0, skipped: int = 0) -> Generator[Any, None, None]:
        """The batches every rank runs.

        Double-buffered: batch i+1 is fetched, checked and its handshake started (asynchronously)
        before batch i is handed to the step, so the exchange overlaps step i's compute.
        ``tagged``: yield ``(batch, token)``; the handshakes issued up to that yield are held under
        ``token`` in the accounting (the pipeline yields a batch later than this, and releases it then).
        ``first_step``, ``skipped``: a resumed epoch's first step and the source batches dropped before.
        """
        step = first_step
        token = object() if tagged else None
        pending = self._fetch(iterator, 0, token)
        in_flight: _Handshake | None = pending
        try:
            for index in itertools.count():
                others = pending.result()
                in_flight = None
                stopping = [rank for rank, r in enumerate(others) if r.stop]
                if stopping:
                    self._on_stop(stopping, functools.reduce(operator.or_, (r.stop for r in others)))
                if any(r.problems for r in others):  # first: a rank whose loader raised must not stop silently
                    self._report(pending.problems, fatal=any(r.fatal for r in others), own_error=pending.error)
                if not all(r.has_batch for r in others):
                    self._note_dropped(others)
                    self._position.exhausted()
                    return
                upcoming = in_flight = self._fetch(iterator, index + 1, token)
                sizes = {r.size for r in others if r.size >= 0}
                if 0 in sizes or (self._equal_sizes_required and len(sizes) > 1):
                    self.skipped_steps += 1
                    self._warn(f"batch {index}: batch sizes per rank {[r.size for r in others]}; skipped on every rank")
                else:
                    self._position.yielded(step, skipped + index + 1)
                    step += 1
                    yield (pending.batch, token) if tagged else pending.batch
                    token = object() if tagged else None
                pending = upcoming
        finally:
            # The loop stopped early (max_steps, limit_*_batches) with the next handshake in flight.
            # Every rank started it, so it completes; wait for it here, while the process group is
            # alive, rather than leave gloo's worker thread holding it until interpreter shutdown.
            if in_flight is not None:
                in_flight.drain()

    def _fetch(self, iterator: Iterator[Any], index: int, token: object | None = None) -> _Handshake:
        # Nothing here may raise before the all-gather: a rank that raised alone would leave the
        # others waiting in the handshake until the process group's timeout.
        error: Exception | None = None
        try:
            batch = next(iterator, _END)
        except Exception as e:  # noqa: BLE001 - reported to every rank, then re-raised here
            batch, error = None, e
        if error is not None:
            problems = [InputProblem(f"batch {index}: the dataloader raised {type(error).__name__}: {error}")]
            size = -1
        else:
            problems, size = self.check(batch, index) if batch is not _END else ([], -1)
        fatal = sum(p.fatal for p in problems)
        mine = torch.tensor([int(batch is not _END), size, len(problems), fatal, int(self._stop_requested())], dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(self._group))]
        with step_phase(BATCH_HANDSHAKE), comm_purpose("batch_handshake"), comm_for_batch(token):
            work = dist.all_gather(gathered, mine, group=self._group, async_op=True)
        return _Handshake(batch, problems, work, gathered, error)

    def check(self, batch: Any, index: int) -> tuple[list[InputProblem], int]:
        """This rank's problems with ``batch`` and its size (-1: no KeyedJaggedTensor); never raises."""
        size = -1
        try:
            kjts = find_kjts(batch)
            size = kjts[0].stride() if kjts else -1
            if self._validator is None:
                return [], size
            return self._validator.check_batch(kjts, batch=index) if kjts else [], size
        except Exception as error:  # noqa: BLE001 - a malformed batch can break any step of the check
            log.debug("TwoDRecStrategy: the input check of batch %d raised", index, exc_info=True)
            return [InputProblem(
                f"batch {index}: checking the batch raised {type(error).__name__}: {error}. The batch is malformed "
                "(e.g. a KeyedJaggedTensor whose keys, lengths, offsets or stride disagree); build it with "
                "KeyedJaggedTensor.from_lengths_sync(keys=..., values=..., lengths=...)."
            )], size

    def _report(self, problems: list[InputProblem], *, fatal: bool, own_error: Exception | None) -> None:
        everyone: list[list[tuple[str, bool]]] = [[] for _ in range(dist.get_world_size(self._group))]
        dist.all_gather_object(everyone, [(p.message, p.fatal) for p in problems], group=self._group)
        if own_error is not None:
            raise raised_on_every_rank(own_error)  # this rank's dataloader failed; the others raise InvalidInputError naming it
        lines = [f"rank {rank}: {m}" for rank, rank_problems in enumerate(everyone) for m, _ in rank_problems]
        message = "invalid sparse input (TwoDRecStrategy validate_inputs=" + repr(self._validate) + "):\n  " + "\n  ".join(lines)
        if self._checked_before:
            message += (
                f"\nThe batches are checked as the dataloader yields them, before {list(self._checked_before)} run, so ids "
                "mapped into range there (hashing, remapping) are checked unmapped, and what those hooks change is not "
                "checked. Map the ids in the dataset or its collate_fn instead, or set GuardConfig(validate_inputs='off')."
            )
        if fatal:
            raise raised_on_every_rank(InvalidInputError(
                message + "\nThese problems stop training whatever validate_inputs says: no clamp can make such a batch right."
            ))
        if self._validate == "error":
            raise raised_on_every_rank(
                InvalidInputError(message + "\nSet validate_inputs='warn' to log and continue (FBGEMM clamps such ids to row 0).")
            )
        self._warn(message)

    def _note_dropped(self, others: list[RankBatch]) -> None:
        ahead = sum(r.has_batch for r in others)
        if ahead:
            self.dropped_batches += ahead
            self._warn(
                f"ranks ran out of batches unevenly (ranks with a batch left: "
                f"{[i for i, r in enumerate(others) if r.has_batch]}); every rank stops here, dropping those batches"
            )

    def _warn(self, message: str) -> None:
        self._warnings += 1
        if self._warnings <= _MAX_WARNINGS:
            suffix = " (further warnings suppressed)" if self._warnings == _MAX_WARNINGS else ""
            log.warning("TwoDRecStrategy: %s%s", message, suffix)


_END = object()


@dataclass
class _Handshake:
    """One batch and the in-flight exchange about it."""

    batch: Any
    problems: list[InputProblem]
    work: Any
    gathered: list[torch.Tensor]
    error: Exception | None = None  # this rank's dataloader raised it

    def result(self) -> list[RankBatch]:
        with step_phase(BATCH_HANDSHAKE):
            self.work.wait()
        return [
            RankBatch(bool(has), size, problems, fatal, stop) for has, size, problems, fatal, stop in (t.tolist() for t in self.gathered)
        ]

    def drain(self) -> None:
        """Wait for the exchange without using it; a failure here (a peer gone) is left to the caller's error."""
        try:
            self.work.wait()
        except (RuntimeError, dist.DistError) as error:  # the run is already ending or failing
            log.debug("in-flight batch handshake failed while closing: %s", error)
