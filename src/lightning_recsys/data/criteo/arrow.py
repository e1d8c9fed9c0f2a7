"""Criteo TSV files parsed by pyarrow's C++ CSV reader, with each rank reading only its own lines.

The features of an example are ``CriteoDataset``'s (see ``lightning_recsys.data.criteo.tsv``): dense
``log(1 + max(x, 0))``, ids ``int(hex, 16) % table_size``, an empty bag for a missing categorical,
and the same malformed-line policy and messages (file and 1-based line number). What differs is who
reads which line:

- **Ranks** take contiguous line ranges. With ``N`` lines in a split's files (read in order as one
  stream), global batch size ``B``, ``W`` ranks and ``b = B / W``, there are ``n = N // B`` full
  global batches; rank ``r`` reads lines ``[r*n*b, (r+1)*n*b)`` and yields ``n`` batches of ``b``
  consecutive lines. The last ``N - n*B`` lines are not read, as the line-by-line reader dropped the
  same partial global batch. With one rank, the batches are exactly ``CriteoDataset``'s.
- To find its range, every rank needs the line count of the files before it: ``LineIndex``
  (``lightning_recsys.data.criteo.ranges``) counts newlines (no parsing) in chunks;
  ``CriteoDataModule`` shares the counting out over the ranks. A rank then seeks to its first line.
  A gzip file cannot be seeked: it is one chunk, and a rank whose range starts inside it
  decompresses (without parsing) what comes before.
- **DataLoader workers** ``k`` of ``m`` parse the rank's batches ``k, k+m, ...``, which the
  DataLoader interleaves back into order: the batches do not depend on ``num_workers``. Each worker
  reads (and scans for line breaks) the rank's whole range but parses only its own batches.
- Batches stay aligned to lines: with ``on_bad_line="skip"`` a batch holding ``s`` malformed lines
  has ``b - s`` examples (the line-by-line reader refilled it from the lines after), so every rank
  still yields ``n`` batches; one whose lines are all malformed is empty, which the strategy skips on
  every rank. Each rank (and worker) checks and logs only the lines it parses.

A background thread reads (and decompresses) windows of whole lines; ``parse_threads`` threads
parse windows side by side (pyarrow and numpy release the GIL), each window in one pyarrow call on
one thread, and build that window's whole batches (``lightning_recsys.data.criteo.parse`` has the
parsing and its checks). A window that might hold a malformed line is read line by line by the exact
Python rules in the consuming thread, in order, which raise or skip with the line's number.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchrec import KeyedJaggedTensor

from lightning_recsys.data.batch import RecBatch
from lightning_recsys.data.criteo.format import CRITEO_FEATURE_NAMES, NUM_CATEGORICAL_FEATURES, CriteoConfig, check_split_files
from lightning_recsys.data.criteo.parse import Parsed, arrow_parse, python_parse
from lightning_recsys.data.criteo.ranges import LineIndex, file_windows, is_gzip
from lightning_recsys.data.module import Split
from lightning_recsys.data.ranks import even_rank_range
from lightning_recsys.data.readers import BadLineTally, CountsSkippedLines, SkippedLineCount

# Re-exported: the byte-range planning lives in criteo_ranges.
__all__ = ["CriteoArrowDataset", "LineIndex", "default_parse_threads", "numpy_criteo_batch", "ordered_map", "prefetch"]

DEFAULT_WINDOW_BYTES = 4 << 20  # bytes per pyarrow call; two threads' windows and their arrays stay in cache (8 MiB measured slower)
_MAX_PARSE_THREADS = 4  # past this the consuming thread (batches, the GIL) is the limit

T = TypeVar("T")
R = TypeVar("R")


def default_parse_threads() -> int:
    """Parse threads of a rank's own process: pyarrow's CPU count (``pyarrow.set_cpu_count`` lowers it), at most 4."""
    return max(1, min(pa.cpu_count(), _MAX_PARSE_THREADS))


def prefetch(items: Iterator[T], depth: int = 2) -> Iterator[T]:
    """``items``, produced by a background thread up to ``depth`` ahead (reading and gzip release the GIL).

    An exception in the producer is raised here; closing this generator early stops the producer.
    """
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    end = object()

    def put(entry: tuple) -> bool:
        while not stop.is_set():
            try:
                slots.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put((item, None)):
                    return
            put((end, None))
        except BaseException as error:  # noqa: BLE001 - handed to the consumer
            put((end, error))

    thread = threading.Thread(target=produce, name="criteo-arrow-reader", daemon=True)
    thread.start()
    try:
        while True:
            item, error = slots.get()
            if item is end:
                if error is not None:
                    raise error
                return
            yield item
    finally:
        stop.set()
        thread.join()


def ordered_map(fn: Callable[[T], R], items: Iterator[T], threads: int) -> Iterator[R]:
    """``fn(item)`` for each item, in order, computed on ``threads`` threads up to ``threads + 1`` items ahead.

    An exception of ``fn`` is raised here, at its item's turn; closing early cancels what has not started.
    """
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="criteo-arrow-parse") as pool:
        pending: deque = deque()
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) > threads:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


class CriteoArrowDataset(CountsSkippedLines, IterableDataset):
    """Rank ``rank``'s batches of a Criteo split, parsed with pyarrow (see the module docstring).

    Args:
        config: the files, table sizes, global batch size and ``on_bad_line`` policy.
        split: which of the config's splits.
        rank, world_size: this rank's place; ``global_batch_size`` must divide by ``world_size``.
        line_index: the split's ``LineIndex``; with more than one rank it is built here if not given
            (one rank needs none: it reads the files from the start).
        window_bytes: bytes of lines parsed per pyarrow call.
        parse_threads: windows parsed side by side in a rank's own process (None:
            ``default_parse_threads()``); inside a DataLoader worker, which is a process already, 1.

    ``skipped_lines``: the lines the last (or current) pass skipped; with DataLoader workers, each
    counts the lines it parses and the main process's dataset has the sum.
    """

    def __init__(
        self,
        config: CriteoConfig,
        split: Split,
        rank: int = 0,
        world_size: int = 1,
        *,
        line_index: LineIndex | None = None,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        parse_threads: int | None = None,
    ) -> None:
        self.start, self.stop = even_rank_range(config.global_batch_size, rank, world_size)
        if window_bytes < 1:
            raise ValueError(f"window_bytes={window_bytes} must be >= 1.")
        if parse_threads is not None and (isinstance(parse_threads, bool) or not isinstance(parse_threads, int) or parse_threads < 1):
            raise ValueError(f"parse_threads={parse_threads!r} must be None or an integer >= 1.")
        self.config, self.split, self.rank, self.world_size = config, split, rank, world_size
        self.paths = [str(p) for p in config.split_paths(split)]
        check_split_files(config, split)
        self.local_batch_size = self.stop - self.start
        self._sizes = config.feature_table_sizes()
        self.window_bytes, self.parse_threads = window_bytes, parse_threads
        if line_index is None and world_size > 1:
            line_index = LineIndex.build(self.paths)
        self.line_index = line_index
        self._skipped = SkippedLineCount()  # each worker counts the lines it parses: ``skipped_lines`` sums them

    def num_batches(self) -> int | None:
        """Batches per rank, when the line count is known (always with more than one rank)."""
        if self.line_index is None:
            return None
        return self.line_index.total // self.config.global_batch_size

    def _line_range(self) -> tuple[int, int | None]:
        """This rank's lines ``[first, end)`` of the stream; ``end`` None: to the end of the files."""
        if self.world_size == 1 and self.line_index is None:
            return 0, None
        n = self.num_batches()
        return self.rank * n * self.local_batch_size, (self.rank + 1) * n * self.local_batch_size

    def _windows(self) -> Iterator[tuple[str, int, bytes, int]]:
        """``(path, first line number, lines, how many)`` of this rank's lines, in order."""
        first, end = self._line_range()
        limit = None if end is None else end - first
        if limit == 0:
            return
        if self.line_index is None:
            begin = [(path, is_gzip(path), 0, 1, 0) for path in self.paths]
        else:
            index = self.line_index
            chunk, skip = index.locate(first)
            c = index.chunks[chunk]
            begin = [(c.path, c.compressed, index.first_offsets[chunk], index.first_line_numbers[chunk], skip)]
            later = self.paths[c.file + 1 :]
            begin += [(path, is_gzip(path), 0, 1, 0) for path in later]
        for path, compressed, offset, number, skip in begin:
            if os.path.getsize(path) == 0:
                continue
            for line_number, data, lines in file_windows(path, compressed, offset, number, skip, limit, self.window_bytes):
                yield path, line_number, data, lines
                if limit is not None:
                    limit -= lines
            if limit == 0:
                return

    def _own_windows(self, worker_id: int, num_workers: int) -> Iterator[tuple]:
        """Per window with some of this worker's lines: ``(path, line number, rank line, pieces, own lines, numbers)``.

        A piece is ``(first, end)`` window lines of one of this worker's batches (the batches are
        consecutive ``b`` lines of the rank's range); ``own`` joins the pieces' lines, and
        ``numbers`` are their file line numbers (None: consecutive from the window's first).
        """
        b = self.local_batch_size
        line = 0  # this rank's line index of the current window's first line
        for path, line_number, data, lines in self._windows():
            pieces = []
            for batch in range(line // b, (line + lines - 1) // b + 1):
                if batch % num_workers == worker_id:
                    lo, hi = max(batch * b, line), min((batch + 1) * b, line + lines)
                    pieces.append((lo - line, hi - line))
            window_first = line
            line += lines
            if not pieces:
                continue
            if num_workers == 1:
                own, numbers = data, None
            else:
                newlines = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)
                starts = np.concatenate([[0], newlines + 1])
                own = b"".join(data[starts[lo] : starts[hi]] for lo, hi in pieces)
                numbers = np.concatenate([np.arange(line_number + lo, line_number + hi) for lo, hi in pieces])
            yield path, line_number, window_first, pieces, own, numbers

    def _parse_window(self, window: tuple) -> tuple[tuple, Parsed | None, dict[int, RecBatch]]:
        """pyarrow's parse of a window's own lines (None: read them exactly) and its whole batches by piece."""
        pieces, own = window[3], window[4]
        parsed = arrow_parse(own, sum(hi - lo for lo, hi in pieces), self._sizes)
        if parsed is None:
            return window, None, {}
        b, at, first_whole, whole = self.local_batch_size, 0, None, []
        for i, (lo, hi) in enumerate(pieces):
            if hi - lo == b:  # a whole batch; in own lines they are consecutive
                first_whole = at if first_whole is None else first_whole
                whole.append(i)
            at += hi - lo
        built = whole_batches(parsed, first_whole, len(whole), b) if whole else []
        return window, parsed, dict(zip(whole, built))

    def __iter__(self) -> Iterator[RecBatch]:
        worker = get_worker_info()
        worker_id, num_workers = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        threads = 1 if worker is not None else (self.parse_threads or default_parse_threads())
        b = self.local_batch_size
        self._skipped.start_pass()
        pending: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        tally: BadLineTally | None = None
        windows = prefetch(self._own_windows(worker_id, num_workers))
        # The exact fallback, the bad-line policy and the batches that span windows stay in this thread.
        for (path, line_number, window_first, pieces, own, numbers), parsed, built in ordered_map(
            self._parse_window, windows, threads
        ):
            if tally is None or tally.path != path:
                if tally is not None:
                    self._skipped.add(tally.finish())
                tally = BadLineTally(path, self.config.on_bad_line)
            if parsed is None:
                if numbers is None:
                    numbers = np.arange(line_number, line_number + own.count(b"\n"))
                parsed = python_parse(own, numbers, self._sizes, tally)
            at = 0
            for i, (lo, hi) in enumerate(pieces):
                if i in built:
                    yield built[i]
                    at += hi - lo
                    continue
                rows = parsed.rows(at, at + hi - lo)
                at += hi - lo
                pending.append((parsed.labels[rows], parsed.dense[rows], parsed.ids[:, rows], parsed.present[:, rows]))
                if (window_first + hi) % b == 0:  # the batch's last line
                    yield self._batch(pending)
                    pending = []
        if tally is not None:
            self._skipped.add(tally.finish())
        # A partial batch (pending) is dropped: with one rank it is the stream's last partial global batch.

    @staticmethod
    def _batch(pieces: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]) -> RecBatch:
        if len(pieces) == 1:
            labels, dense, ids, present = pieces[0]
        else:
            labels, dense = np.concatenate([p[0] for p in pieces]), np.concatenate([p[1] for p in pieces])
            ids, present = np.concatenate([p[2] for p in pieces], axis=1), np.concatenate([p[3] for p in pieces], axis=1)
        return numpy_criteo_batch(labels, dense, ids, present)


def numpy_criteo_batch(labels: np.ndarray, dense: np.ndarray, ids: np.ndarray, present: np.ndarray | None = None) -> RecBatch:
    """``criteo_batch`` from numpy arrays (ids ``[26, B]``; missing: ``present`` False, or -1 without it).

    The KJT's per-key sums are done in numpy, and its offsets left to TorchRec (computed from the
    lengths when first asked for, on whatever device the batch is by then).
    """
    present = ids >= 0 if present is None else present
    per_key = present.sum(axis=1)
    sparse = KeyedJaggedTensor(
        keys=CRITEO_FEATURE_NAMES,
        values=torch.from_numpy(ids[present]),
        lengths=torch.from_numpy(present.reshape(-1).astype(np.int64)),
        stride=ids.shape[1],
        length_per_key=per_key.tolist(),
        offset_per_key=[0, *np.cumsum(per_key).tolist()],
    )
    return RecBatch(
        dense=torch.from_numpy(np.ascontiguousarray(dense)),
        sparse=sparse,
        labels=torch.from_numpy(np.ascontiguousarray(labels)),
    )


def whole_batches(parsed: Parsed, start: int, count: int, b: int) -> list[RecBatch]:
    """``count`` batches of ``b`` consecutive rows from row ``start`` of an arrow-parsed window, built at once.

    The ids are laid out batch-major (batch, feature, row) once, so each batch's KJT values and
    lengths are contiguous slices of window-wide arrays.
    """
    end = start + count * b
    present = np.ascontiguousarray(parsed.present[:, start:end].reshape(NUM_CATEGORICAL_FEATURES, count, b).transpose(1, 0, 2))
    values = parsed.ids[:, start:end].reshape(NUM_CATEGORICAL_FEATURES, count, b).transpose(1, 0, 2)[present]
    lengths = torch.from_numpy(present.reshape(count, NUM_CATEGORICAL_FEATURES * b).astype(np.int64))
    per_key = present.sum(axis=2)  # [count, 26]
    value_starts = np.concatenate([[0], np.cumsum(per_key.sum(axis=1))]).tolist()
    key_offsets = np.concatenate([np.zeros((count, 1), dtype=np.int64), np.cumsum(per_key, axis=1)], axis=1).tolist()
    values_t = torch.from_numpy(values)
    labels, dense = torch.from_numpy(parsed.labels[start:end]), torch.from_numpy(parsed.dense[start:end])
    batches = []
    for j, lengths_per_key in enumerate(per_key.tolist()):
        rows = slice(j * b, (j + 1) * b)
        sparse = KeyedJaggedTensor(
            keys=CRITEO_FEATURE_NAMES,
            values=values_t[value_starts[j] : value_starts[j + 1]],
            lengths=lengths[j],
            stride=b,
            length_per_key=lengths_per_key,
            offset_per_key=key_offsets[j],
        )
        batches.append(RecBatch(dense=dense[rows], sparse=sparse, labels=labels[rows]))
    return batches
