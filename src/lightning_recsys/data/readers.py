"""What the file readers share: rank slices of global batches, text/gzip lines, and the bad-line policy.

Every reader turns its files into one deterministic stream of examples. ``GlobalBatchDataset`` groups
that stream into global batches of ``global_batch_size`` examples and yields rank ``r``'s contiguous
slice ``[r * B / W, (r + 1) * B / W)`` of each one, so the examples a step trains on do not depend on
the world size ``W``. Every rank reads (and checks) the whole stream, so a skipped malformed line is
skipped on every rank alike and the ranks stay in step.
"""

from __future__ import annotations

import gzip
import logging
import os
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import torch
from torch.utils.data import IterableDataset, get_worker_info

from lightning_recsys.data.batch import RecBatch
from lightning_recsys.data.ranks import even_rank_range

log = logging.getLogger(__name__)

OnBadLine = Literal["error", "skip"]
ON_BAD_LINE_CHOICES: tuple[str, ...] = ("error", "skip")

_GZIP_MAGIC = b"\x1f\x8b"
_MAX_LINE_IN_MESSAGE = 120
MAX_COUNTED_WORKERS = 128  # DataLoader workers whose skipped lines reach the main process

Record = TypeVar("Record")


class MalformedLineError(ValueError):
    """A data file has a line that cannot be parsed.

    ``path``, ``line_number`` (1-based), ``line`` and ``problem`` are kept as attributes. The message
    is the only required argument so that DataLoader workers can re-raise the error unchanged.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        line_number: int | None = None,
        line: str | None = None,
        problem: str | None = None,
    ) -> None:
        super().__init__(message)
        self.path, self.line_number, self.line, self.problem = path, line_number, line, problem


def malformed_line_error(path: str, line_number: int, line: str, problem: str) -> MalformedLineError:
    """The error for line ``line_number`` of ``path``: where, what is wrong, and how to skip such lines."""
    shown = line if len(line) <= _MAX_LINE_IN_MESSAGE else line[:_MAX_LINE_IN_MESSAGE] + "..."
    return MalformedLineError(
        f"{path}, line {line_number}: {problem}. The line is {shown!r}. Fix or remove the line, or pass "
        "on_bad_line='skip' to skip malformed lines (they are counted, and logged once per file).",
        path=path,
        line_number=line_number,
        line=line,
        problem=problem,
    )


def damaged_gzip_error(path: str | Path, error: BaseException) -> OSError:
    """The error for a gzip file that cannot be decompressed: the libraries' own messages do not name the file."""
    return OSError(f"{path}: the gzip data is damaged or truncated ({error}); check the file with gzip -t {path}.")


def check_on_bad_line(value: str) -> None:
    if value not in ON_BAD_LINE_CHOICES:
        raise ValueError(f"on_bad_line={value!r} is not one of {list(ON_BAD_LINE_CHOICES)}.")


def check_global_batch_size(value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"global_batch_size={value!r} must be an integer >= 1.")


def check_num_workers(value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"num_workers={value!r} must be an integer >= 0.")


def check_split_sources(splits: dict[str, list], what: str, key: Callable[[Any], Any] = lambda source: source) -> None:
    """Refuse a source (file, day) listed twice in one split; warn when train shares one with val or test.

    A repeat was read twice per epoch without a word; an overlap is sometimes meant (a smoke test
    validating on its training file), but otherwise it makes the validation score a training score.
    ``splits`` starts with train; ``key`` compares sources (e.g. normalized paths); ``what`` names them.
    """
    keys = {name: [key(source) for source in sources] for name, sources in splits.items()}
    for name, sources in splits.items():
        twice = sorted({str(s) for s, k in zip(sources, keys[name]) if keys[name].count(k) > 1})
        if twice:
            raise ValueError(
                f"{name}={list(sources)!r} lists {what} {', '.join(twice)} more than once: an epoch would read "
                "it that many times. List each once (train longer with trainer.max_epochs)."
            )
    train, *others = splits
    for name in others:
        shared = sorted(str(s) for s, k in zip(splits[name], keys[name]) if k in set(keys[train]))
        if shared:
            warnings.warn(
                f"{name} and {train} share {what} {', '.join(shared)}: the {name} metrics then include examples "
                "the model trained on.",
                stacklevel=3,
            )


def normalized_path(path: str | Path) -> str:
    """One spelling per file, so ``a.tsv`` and ``./a.tsv`` compare equal."""
    return os.path.normcase(os.path.abspath(os.path.expanduser(str(path))))


class BadLineTally:
    """Applies the ``on_bad_line`` policy to the lines of one file and counts the lines it skipped."""

    def __init__(self, path: str, on_bad_line: OnBadLine, *, warn: bool = True) -> None:
        self.path, self.on_bad_line, self.warn = path, on_bad_line, warn
        self.count = 0
        self._first: str | None = None  # the first skipped line's problem, for the warning

    def bad(self, line_number: int, line: str, problem: str) -> None:
        """Raise ``MalformedLineError`` (``"error"``), or count the line so the caller skips it (``"skip"``)."""
        if self.on_bad_line == "error":
            raise malformed_line_error(self.path, line_number, line, problem)
        self.count += 1
        if self._first is None:
            self._first = f"line {line_number}: {problem}"

    def finish(self) -> int:
        """Log one warning for the file if it had skipped lines; return how many."""
        if self.count and self.warn:
            log.warning(
                "Skipped %d malformed line(s) of %s (on_bad_line='skip'); the first was %s.",
                self.count,
                self.path,
                self._first,
            )
        return self.count


class SkippedLineCount:
    """Malformed lines one dataset skipped in its current (or last) pass, summed over DataLoader worker processes.

    Workers iterate their own copies of a dataset, so a count kept in a plain attribute never reached
    the main process: its ``skipped_lines`` read 0 with ``num_workers > 0``. The count lives in a small
    shared-memory tensor made with the dataset, before any worker starts (fork and spawn both share
    it): slot 0 is the main process's, slot ``k + 1`` worker ``k``'s, each written by its own process
    only, so no lock is needed. A worker pass zeros its slot when it starts; worker 0 also zeros the
    slots no worker of this pass writes (an earlier pass in the main process, or with more workers).
    """

    def __init__(self) -> None:
        self._slots = torch.zeros(MAX_COUNTED_WORKERS + 1, dtype=torch.int64).share_memory_()

    def start_pass(self) -> None:
        """Zero the count this process's pass is about to make."""
        worker = get_worker_info()
        if worker is None:
            self._slots.zero_()
            return
        if worker.id < MAX_COUNTED_WORKERS:
            self._slots[worker.id + 1] = 0
        if worker.id == 0:
            self._slots[0] = 0
            self._slots[worker.num_workers + 1 :] = 0
            if worker.num_workers > MAX_COUNTED_WORKERS:
                log.warning(
                    "num_workers=%d: only the malformed lines skipped by the first %d DataLoader workers reach the main "
                    "process, so its skipped_lines may undercount; use at most %d workers for an exact count.",
                    worker.num_workers, MAX_COUNTED_WORKERS, MAX_COUNTED_WORKERS,
                )

    def add(self, count: int) -> None:
        """Add ``count`` skipped lines to this process's slot."""
        worker = get_worker_info()
        if worker is None:
            self._slots[0] += count
        elif worker.id < MAX_COUNTED_WORKERS:
            self._slots[worker.id + 1] += count

    def set(self, count: int) -> None:
        """Make the count ``count`` (one known in the main process, e.g. lines skipped while loading files)."""
        self._slots.zero_()
        self._slots[0] = count

    def total(self) -> int:
        return int(self._slots.sum())


class CountsSkippedLines:
    """``skipped_lines``: malformed lines skipped by the current (or last) pass, in the main process too
    when DataLoader workers read (``SkippedLineCount``)."""

    _skipped: SkippedLineCount

    @property
    def skipped_lines(self) -> int:
        return self._skipped.total()

    @skipped_lines.setter
    def skipped_lines(self, value: int) -> None:
        self._skipped.set(value)


def iter_lines(path: str | Path, encoding: str = "utf-8") -> Iterator[tuple[int, str]]:
    """``(1-based line number, line without its line break)`` for a plain-text or gzip file.

    Gzip is detected by its magic bytes, not the suffix. Undecodable bytes become U+FFFD, so they
    surface as a malformed line (with its number) rather than as a decoding error mid-file.
    """
    with open(path, "rb") as raw:
        is_gzip = raw.read(2) == _GZIP_MAGIC
    opener = gzip.open if is_gzip else open
    # newline="\n": a stray "\r" stays inside its line (and makes it malformed) instead of splitting it.
    with opener(path, "rt", encoding=encoding, errors="replace", newline="\n") as text:
        lines = enumerate(text, 1)
        while True:
            try:
                line_number, line = next(lines)
            except StopIteration:
                return
            except (EOFError, OSError, zlib.error) as error:
                if not is_gzip:
                    raise
                raise damaged_gzip_error(path, error) from error
            # Only the line break: trailing tabs are empty fields, not whitespace.
            yield line_number, line.rstrip("\r\n")


class GlobalBatchDataset(CountsSkippedLines, IterableDataset, Generic[Record]):
    """Groups a subclass's record stream into global batches and yields this rank's slice of each.

    Subclasses implement ``_records`` (every record of the split, in order, on every rank) and
    ``_collate`` (this rank's records of one global batch into a ``RecBatch``). A final partial
    global batch is dropped on every rank, so all ranks yield the same number of equal-size batches.
    Inside DataLoader worker ``k`` of ``n``, only global batches ``k, k + n, ...`` are yielded, which
    the DataLoader interleaves back into the original order.
    """

    def __init__(self, *, global_batch_size: int, rank: int, world_size: int) -> None:
        check_global_batch_size(global_batch_size)
        self.start, self.stop = even_rank_range(global_batch_size, rank, world_size)
        self.global_batch_size, self.rank, self.world_size = global_batch_size, rank, world_size
        self._skipped = SkippedLineCount()  # malformed lines skipped in the files behind this split

    def _records(self, warn: bool) -> Iterator[Record]:
        """Every record of the split in order; ``warn`` says whether this copy logs skipped lines."""
        raise NotImplementedError

    def _collate(self, records: list[Record]) -> RecBatch:
        raise NotImplementedError

    def __iter__(self) -> Iterator[RecBatch]:
        worker = get_worker_info()
        worker_id, num_workers = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        own: list[Record] = []
        position = batch_index = 0
        # Only one process logs skipped lines: every rank and worker reads and skips the same ones.
        for record in self._records(warn=self.rank == 0 and worker_id == 0):
            mine = batch_index % num_workers == worker_id
            if mine and self.start <= position < self.stop:
                own.append(record)
            position += 1
            if position == self.global_batch_size:
                if mine:
                    yield self._collate(own)
                own, position, batch_index = [], 0, batch_index + 1
        # A partial global batch (position > 0) is dropped here, on every rank alike.
