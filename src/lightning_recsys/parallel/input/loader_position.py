"""Where a training epoch is in its dataloader, so that a mid-epoch checkpoint resumes at the next batch.

A loop that saves mid-epoch asks the loader it iterates for ``state_dict()`` and, on resume, hands
it back through ``load_state_dict()`` before iterating again (Lightning does, for any loader with
both methods). Batches are fetched ahead of the step (the loop's prefetch, the batch handshake, the
pipelined input distribution), and a step may be skipped on every rank, so the position saved is the
source loader's, counted just after the last batch whose step ran (``progress()``), not what was
fetched. On resume the new iteration reads and drops that many batches first: the loader must give
the same batches again, as a deterministic loader does (every built-in DataModule).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

_LOOKAHEAD = 64  # yields remembered: far more than any prefetch depth between a yield and its step
_KEYS = ("trained_batches", "source_batches", "epoch_done")

# () -> (steps that ran in this epoch, whether the loop counts the epoch as complete)
Progress = Callable[[], tuple[int, bool]]


class LoaderPosition:
    """Maps "steps run this epoch" to "source batches consumed" for one wrapped training loader."""

    def __init__(self, progress: Progress | None) -> None:
        self._progress = progress
        self._after: deque[tuple[int, int]] = deque(maxlen=_LOOKAHEAD)
        self._resume: tuple[int, int] | None = None
        self._exhausted = False

    def start(self) -> tuple[int, int]:
        """A new iteration: ``(its first step's index in the epoch, source batches to drop first)``."""
        trained, source = self._resume or (0, 0)
        self._resume, self._exhausted = None, False
        self._after.clear()
        self._after.append((trained, source))
        return trained, source

    def yielded(self, step_index: int, source_after: int) -> None:
        """The batch of the epoch's step ``step_index`` was handed on; the source had given ``source_after`` batches."""
        self._after.append((step_index + 1, source_after))

    def exhausted(self) -> None:
        self._exhausted = True

    def state_dict(self) -> dict[str, Any]:
        if self._progress is None or not self._after:
            return {}  # no Lightning progress to map, or never iterated: nothing to resume
        trained, loop_says_done = self._progress()
        for count, source in reversed(self._after):
            if count == trained:
                return {"trained_batches": trained, "source_batches": source, "epoch_done": loop_says_done or self._exhausted}
        if loop_says_done:
            # The loop counts the epoch complete, but this iteration handed on none of its steps' batches: it was
            # restored from an end-of-epoch checkpoint and ran no step since (a fit already at max_steps or
            # max_epochs). Nothing of this epoch is left to resume, so the position inside it does not matter.
            return {"trained_batches": trained, "source_batches": max(trained, self._after[-1][1]), "epoch_done": True}
        raise RuntimeError(
            f"loader position: {trained} steps ran in this epoch, but the batches handed on cover steps "
            f"{self._after[0][0]}-{self._after[-1][0]}; the loop and the loader disagree on what was trained."
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        missing = [k for k in _KEYS if k not in state]
        if missing or any(isinstance(state[k], bool) or not isinstance(state[k], int) or state[k] < 0 for k in _KEYS[:2]):
            raise ValueError(
                f"loader position state {state!r} is malformed: it needs non-negative integers {list(_KEYS[:2])} and "
                f"'epoch_done' (missing: {missing}). The checkpoint's loop state is damaged; resume from another one."
            )
        self._resume = None if state["epoch_done"] else (state["trained_batches"], state["source_batches"])


def drop_first(iterator: Iterator[Any], count: int, end: object) -> Iterator[Any]:
    """``iterator`` without its first ``count`` items, dropped lazily at the first ``next`` (so its errors surface there)."""
    for _ in range(count):
        if next(iterator, end) is end:
            return
    yield from iterator


__all__ = ["LoaderPosition", "Progress", "drop_first"]
