"""Criteo TSV files parsed by pyarrow's C++ CSV reader, with each rank reading only its own lines.

The features of an example are ``CriteoDataset``'s (see ``lightning_recsys.data.criteo``): dense
``log(1 + max(x, 0))``, ids ``int(hex, 16) % table_size``, an empty bag for a missing categorical,
and the same malformed-line policy and messages (file and 1-based line number). What differs is who
reads which line:

- **Ranks** take contiguous line ranges. With ``N`` lines in a split's files (read in order as one
  stream), global batch size ``B``, ``W`` ranks and ``b = B / W``, there are ``n = N // B`` full
  global batches; rank ``r`` reads lines ``[r*n*b, (r+1)*n*b)`` and yields ``n`` batches of ``b``
  consecutive lines. The last ``N - n*B`` lines are not read, as the line-by-line reader dropped the
  same partial global batch. With one rank, the batches are exactly ``CriteoDataset``'s.
- To find its range, every rank needs the line count of the files before it: ``LineIndex`` counts
  newlines (no parsing) in chunks of ``chunk_bytes``; ``CriteoDataModule`` shares the counting out
  over the ranks. A rank then seeks to its first line. A gzip file cannot be seeked: it is one
  chunk, and a rank whose range starts inside it decompresses (without parsing) what comes before.
- **DataLoader workers** ``k`` of ``m`` parse the rank's batches ``k, k+m, ...``, which the
  DataLoader interleaves back into order: the batches do not depend on ``num_workers``. Each worker
  reads (and scans for line breaks) the rank's whole range but parses only its own batches.
- Batches stay aligned to lines: with ``on_bad_line="skip"`` a batch holding ``s`` malformed lines
  has ``b - s`` examples (the line-by-line reader refilled it from the lines after), so every rank
  still yields ``n`` batches; one whose lines are all malformed is empty, which the strategy skips on
  every rank. Each rank (and worker) checks and logs only the lines it parses.

A window of lines goes to pyarrow only after cheap whole-window checks (allowed bytes only, the
field count, label, integer and hex syntax, all vectorized); a window that fails any of them is read
line by line by the exact Python rules instead, which raise or skip with the line's number.
Reading, decompressing and parsing run one window ahead in a background thread. In a rank's own
process pyarrow parses with its CPU pool (every core by default; ``pyarrow.set_cpu_count`` shares a
host between ranks); inside DataLoader workers it parses with one thread each.
"""

from __future__ import annotations

import bisect
import os
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pa_compute
import pyarrow.csv as pa_csv
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchrec import KeyedJaggedTensor

from lightning_recsys.data.batch import RecBatch
from lightning_recsys.data.criteo import (
    _LINE,
    CRITEO_FEATURE_NAMES,
    NUM_CATEGORICAL_FEATURES,
    NUM_INTEGER_FEATURES,
    CriteoConfig,
    _diagnose,
    dense_transform,
    parse_criteo_rows,
)
from lightning_recsys.data.module import Split
from lightning_recsys.data.readers import _GZIP_MAGIC, BadLineTally, rank_slice

DEFAULT_CHUNK_BYTES = 64 << 20  # plain-file bytes per line-count chunk
DEFAULT_WINDOW_BYTES = 8 << 20  # bytes handed to pyarrow at a time
_BLOCK_BYTES = 1 << 20  # pyarrow's parse block: its unit of multi-threading
_NUM_FIELDS = 1 + NUM_INTEGER_FEATURES + NUM_CATEGORICAL_FEATURES
_MAX_HEX_DIGITS = 16  # longer values (never in the released files) take the exact Python path

# Bytes a valid window can hold; anything else (\r, spaces, "+", "x", non-ASCII) sends it to the exact path.
_ALLOWED = b"0123456789abcdefABCDEF-\t\n"
_COLUMNS = [str(i) for i in range(_NUM_FIELDS)]
_PARSE = pa_csv.ParseOptions(
    delimiter="\t", quote_char=False, escape_char=False, double_quote=False, newlines_in_values=False,
    ignore_empty_lines=False,
)
_CONVERT = pa_csv.ConvertOptions(
    column_types={
        name: pa.int64() if 1 <= i <= NUM_INTEGER_FEATURES else pa.binary() for i, name in enumerate(_COLUMNS)
    },
    null_values=[""],  # a missing integer; binary columns keep "" (strings_can_be_null=False)
    strings_can_be_null=False,
    quoted_strings_can_be_null=False,
)
_NIBBLE = np.full(256, 255, dtype=np.uint8)  # ASCII hex digit -> value; 255 marks a non-digit
for _i, _c in enumerate(b"0123456789abcdef"):
    _NIBBLE[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _NIBBLE[_c] = 10 + _i
_U64 = np.uint64


def is_gzip(path: str) -> bool:
    with open(path, "rb") as raw:
        return raw.read(2) == _GZIP_MAGIC


@dataclass(frozen=True)
class FileChunk:
    """Bytes ``[start, stop)`` of ``path``, the split's file number ``file``; it holds the lines that start there.

    A gzip file is one chunk.
    """

    path: str
    file: int
    start: int
    stop: int
    compressed: bool


def file_chunks(paths: list[str], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[FileChunk]:
    """The chunks of ``paths`` in order: plain files cut every ``chunk_bytes``, gzip files whole."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes={chunk_bytes} must be >= 1.")
    chunks = []
    for file, path in enumerate(paths):
        size = os.path.getsize(path)
        if size == 0:
            continue
        if is_gzip(path):
            chunks.append(FileChunk(str(path), file, 0, size, True))
        else:
            chunks.extend(FileChunk(str(path), file, a, min(a + chunk_bytes, size), False) for a in range(0, size, chunk_bytes))
    return chunks


def count_chunk_lines(chunk: FileChunk) -> tuple[int, int]:
    """``(lines that start in the chunk, byte offset of the first of them)``, from newlines alone."""
    if chunk.compressed:
        count, last = 0, b"\n"
        with _open(chunk.path, True, 0) as stream:
            while block := stream.read(16 << 20):
                count += block.count(b"\n")
                last = block[-1:]
        return count + (last != b"\n"), 0
    # A line starts at byte 0 and after every newline at p, i.e. at p + 1 in [start, stop).
    low = max(chunk.start - 1, 0)
    count, first, position = int(chunk.start == 0), (0 if chunk.start == 0 else None), low
    with open(chunk.path, "rb") as raw:
        raw.seek(low)
        remaining = chunk.stop - 1 - low
        while remaining > 0:
            block = raw.read(min(remaining, 16 << 20))
            if not block:
                break
            if first is None and (i := block.find(b"\n")) >= 0:
                first = position + i + 1
            count += block.count(b"\n")
            position += len(block)
            remaining -= len(block)
    return count, chunk.stop if first is None else first


class LineIndex:
    """Line counts of a split's files by chunk: where any line of the stream starts.

    ``counts[i]`` lines start in ``chunks[i]``, the first at byte ``first_offsets[i]``.
    """

    def __init__(self, chunks: list[FileChunk], counts: list[int], first_offsets: list[int]) -> None:
        if not len(chunks) == len(counts) == len(first_offsets):
            raise ValueError("chunks, counts and first_offsets must have one entry per chunk.")
        self.chunks, self.counts, self.first_offsets = chunks, [int(c) for c in counts], [int(o) for o in first_offsets]
        self.starts: list[int] = np.concatenate([[0], np.cumsum(self.counts, dtype=np.int64)]).tolist()
        # 1-based line number, within its file, of each chunk's first line.
        self.first_line_numbers: list[int] = []
        number = 1
        for chunk, count in zip(chunks, self.counts):
            number = 1 if chunk.start == 0 else number
            self.first_line_numbers.append(number)
            number += count

    @classmethod
    def build(cls, paths: list[str], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> LineIndex:
        """Count every chunk here (one process); ``CriteoDataModule`` shares the counting over the ranks."""
        chunks = file_chunks(paths, chunk_bytes)
        counted = [count_chunk_lines(chunk) for chunk in chunks]
        return cls(chunks, [c for c, _ in counted], [o for _, o in counted])

    @property
    def total(self) -> int:
        return self.starts[-1]

    def locate(self, line: int) -> tuple[int, int]:
        """``(chunk, lines to skip from the chunk's first line)`` of the stream's line ``line`` (0-based)."""
        if not 0 <= line < self.total:
            raise IndexError(f"line {line} is outside the stream's {self.total} lines.")
        chunk = bisect.bisect_right(self.starts, line) - 1
        return chunk, line - self.starts[chunk]


def _line_end(data: bytes, n: int) -> int:
    """The offset just past the ``n``-th (1-based) newline of ``data``."""
    return int(np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)[n - 1]) + 1


def _open(path: str, compressed: bool, start: int):
    if compressed:
        if start:
            raise ValueError(f"{path} is gzip: it can only be read from its start.")
        # pyarrow's zlib stream: C++ that releases the GIL for a whole read (Python's gzip does not).
        return pa.CompressedInputStream(pa.OSFile(path, "rb"), "gzip")
    raw = open(path, "rb")  # noqa: SIM115 - returned to the caller's with-block
    raw.seek(start)
    return raw


def _file_windows(
    path: str, compressed: bool, start: int, line_number: int, skip: int, limit: int | None, window_bytes: int
) -> Iterator[tuple[int, bytes, int]]:
    """``(number of the first line, whole lines ending in newlines, how many)`` of ``path`` from byte ``start``.

    ``start`` is a line start, that of line ``line_number``; ``skip`` lines are passed over first
    (read, not parsed), and at most ``limit`` lines (``None``: all) are yielded.
    """
    with _open(path, compressed, start) as stream:
        carry = b""
        while limit is None or limit > 0:
            block = stream.read(window_bytes)
            data = carry + block if carry else block
            if not block:  # the end of the file: what is left is one last line without a newline
                if not data:
                    return
                window, carry = (data if data.endswith(b"\n") else data + b"\n"), b""
            else:
                cut = data.rfind(b"\n") + 1
                if cut == 0:  # a line longer than the window so far
                    carry = data
                    continue
                window, carry = (data, b"") if cut == len(data) else (data[:cut], data[cut:])
            lines = window.count(b"\n")
            if skip:
                if skip >= lines:
                    skip, line_number = skip - lines, line_number + lines
                    continue
                window, lines, line_number, skip = window[_line_end(window, skip) :], lines - skip, line_number + skip, 0
            if limit is not None and lines >= limit:
                window, lines = window[: _line_end(window, limit)], limit
            yield line_number, window, lines
            line_number += lines
            if limit is not None:
                limit -= lines
            if not block:
                return


def prefetch(items: Iterator, depth: int = 2) -> Iterator:
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


@dataclass
class _Parsed:
    """Parsed lines: labels ``[n]``, dense ``[n, 13]``, ids ``[26, n]`` of the valid ones; ``valid`` over all lines."""

    labels: np.ndarray
    dense: np.ndarray
    ids: np.ndarray
    valid: np.ndarray | None  # None: every line is valid

    def rows(self, first_line: int, end_line: int) -> slice:
        if self.valid is None:
            return slice(first_line, end_line)
        if not hasattr(self, "_row_at"):
            self._row_at = np.concatenate([[0], np.cumsum(self.valid)])
        return slice(int(self._row_at[first_line]), int(self._row_at[end_line]))


def _hex_values(column: pa.ChunkedArray, values: np.ndarray, present: np.ndarray) -> bool:
    """Writes ``int(value, 16)`` and whether the value is there into the rows' slots; False if one is not hex."""
    position = 0
    for chunk in column.chunks:
        k = len(chunk)
        offsets = np.frombuffer(chunk.buffers()[1], dtype=np.int32, count=k + 1, offset=chunk.offset * 4)
        lengths = np.diff(offsets)
        here = lengths > 0
        present[position : position + k] = here
        target = values[position : position + k]
        position += k
        target.fill(0)
        if not here.any():
            continue
        data = np.frombuffer(chunk.buffers()[2], dtype=np.uint8, count=int(offsets[-1] - offsets[0]), offset=int(offsets[0]))
        if (lengths[here] == 8).all():  # 8 digits, read 8 bytes at a time
            decoded = _swar_hex8(data.view(">u8").astype(_U64))
            if decoded is None:
                return False
            target[here] = decoded
        else:
            if lengths.max() > _MAX_HEX_DIGITS:
                return False
            digits = _NIBBLE[data]
            if (digits == 255).any():
                return False
            row = np.repeat(np.arange(k), lengths)
            ends = (offsets[1:] - offsets[0])[row]
            shifts = (4 * (ends - 1 - np.arange(len(data)))).astype(_U64)
            starts = (offsets[:-1] - offsets[0])[here]
            target[here] = np.bitwise_or.reduceat(digits.astype(_U64) << shifts, starts)
    return True


def _swar_hex8(words: np.ndarray) -> np.ndarray | None:
    """The values of big-endian words of 8 ASCII hex digits each, or None if a byte is not a hex digit."""
    # Digits have bit 4 set and letters bit 6; "-", the only other byte that gets here, neither.
    if (((words >> _U64(4)) | (words >> _U64(6))) & _U64(0x0101010101010101) != _U64(0x0101010101010101)).any():
        return None
    nibbles = (words & _U64(0x0F0F0F0F0F0F0F0F)) + _U64(9) * ((words >> _U64(6)) & _U64(0x0101010101010101))
    nibbles = ((nibbles >> _U64(4)) | nibbles) & _U64(0x00FF00FF00FF00FF)
    nibbles = ((nibbles >> _U64(8)) | nibbles) & _U64(0x0000FFFF0000FFFF)
    return ((nibbles >> _U64(16)) | nibbles) & _U64(0x00000000FFFFFFFF)


def _hex8_values(columns: list[pa.Array], values: np.ndarray, present: np.ndarray) -> bool:
    """All columns at once when every value has 8 digits or none (the released files); False otherwise."""
    datas = []
    for f, column in enumerate(columns):
        k = len(column)
        offsets = np.frombuffer(column.buffers()[1], dtype=np.int32, count=k + 1, offset=column.offset * 4)
        lengths = np.diff(offsets)
        here = lengths > 0
        if not ((lengths == 8) | ~here).all():
            return False
        present[f] = here
        datas.append(np.frombuffer(column.buffers()[2], dtype=np.uint8, count=int(offsets[-1] - offsets[0]), offset=int(offsets[0])))
    words = np.concatenate(datas).view(">u8").astype(_U64)
    decoded = _swar_hex8(words)
    if decoded is None:
        return False
    values.fill(0)
    values[present] = decoded  # row-major: column by column, rows in order, as the data was joined
    return True


@dataclass
class RawColumns:
    """Lines as the files hold them: labels, integers (missing: 0) and hex values (missing: 0, ``present`` False)."""

    positive: np.ndarray  # [n] bool
    integers: np.ndarray  # [n, 13] int64
    hex_values: np.ndarray  # [26, n] uint64
    present: np.ndarray  # [26, n] bool


def arrow_raw_columns(data: bytes, lines: int, use_threads: bool = True) -> RawColumns | None:
    """Every line of ``data`` (whole lines) parsed by pyarrow, or None if any line might be malformed."""
    if data.translate(None, _ALLOWED):
        return None
    try:
        table = pa_csv.read_csv(
            pa.py_buffer(data),
            read_options=pa_csv.ReadOptions(
                use_threads=use_threads,
                # Blocks are the unit of pyarrow's threads; one thread does best with one block.
                block_size=_BLOCK_BYTES if use_threads else max(len(data), 1),
                column_names=_COLUMNS,
            ),
            parse_options=_PARSE,
            convert_options=_CONVERT,
        )
    except pa.ArrowInvalid:  # a wrong field count, or an integer field that is not -?[0-9]+ (or overflows)
        return None
    if table.num_rows != lines:
        return None
    label = table.column(0).combine_chunks()
    offsets = np.frombuffer(label.buffers()[1], dtype=np.int32, count=lines + 1, offset=label.offset * 4)
    if lines and (offsets[-1] - offsets[0] != lines or (np.diff(offsets) != 1).any()):
        return None
    label_bytes = np.frombuffer(label.buffers()[2], dtype=np.uint8, count=lines, offset=int(offsets[0]))
    positive = label_bytes == ord("1")
    if not (positive | (label_bytes == ord("0"))).all():
        return None
    hex_values = np.empty((NUM_CATEGORICAL_FEATURES, lines), dtype=_U64)
    present = np.empty((NUM_CATEGORICAL_FEATURES, lines), dtype=bool)
    columns = [table.column(1 + NUM_INTEGER_FEATURES + f).combine_chunks() for f in range(NUM_CATEGORICAL_FEATURES)]
    if not _hex8_values(columns, hex_values, present):
        for f, column in enumerate(columns):
            if not _hex_values(pa.chunked_array([column]), hex_values[f], present[f]):
                return None
    integers = np.empty((lines, NUM_INTEGER_FEATURES), dtype=np.int64)
    for i in range(NUM_INTEGER_FEATURES):
        integers[:, i] = pa_compute.fill_null(table.column(1 + i), 0).to_numpy()
    return RawColumns(positive=positive, integers=integers, hex_values=hex_values, present=present)


_LOG_TABLE_SIZE = 1 << 20
_log_table: np.ndarray | None = None


def _dense(integers: np.ndarray) -> np.ndarray:
    """``dense_transform`` of int64 integers: looked up below 2^20 (a table made by it), computed above."""
    global _log_table
    if _log_table is None:
        _log_table = dense_transform(torch.arange(_LOG_TABLE_SIZE, dtype=torch.float64)).numpy()
    dense = _log_table[np.clip(integers, 0, _LOG_TABLE_SIZE - 1)]
    large = integers >= _LOG_TABLE_SIZE
    if large.any():
        dense[large] = dense_transform(torch.from_numpy(integers[large].astype(np.float64))).numpy()
    return dense


def _arrow_parse(data: bytes, lines: int, sizes: list[int], use_threads: bool) -> _Parsed | None:
    raw = arrow_raw_columns(data, lines, use_threads)
    if raw is None:
        return None
    ids = (raw.hex_values % np.asarray(sizes, dtype=_U64)[:, None]).astype(np.int64)
    ids[~raw.present] = -1
    return _Parsed(labels=raw.positive.astype(np.float32), dense=_dense(raw.integers), ids=ids, valid=None)


def _python_parse(data: bytes, line_numbers: np.ndarray, sizes: list[int], tally: BadLineTally) -> _Parsed:
    """The line-by-line reader's rules on ``data``: raise or skip (counted) each malformed line."""
    lines = data.decode("utf-8", errors="replace").split("\n")[:-1]  # data ends with a newline
    valid = np.zeros(len(lines), dtype=bool)
    rows = []
    for i, line in enumerate(lines):
        line = line.rstrip("\r\n")
        if _LINE.fullmatch(line) is None:
            tally.bad(int(line_numbers[i]), line, _diagnose(line))
            continue
        valid[i] = True
        rows.append(line.split("\t"))
    labels, dense, ids = parse_criteo_rows(rows, sizes)
    return _Parsed(labels=labels.numpy(), dense=dense.numpy(), ids=ids.numpy(), valid=valid)


class CriteoArrowDataset(IterableDataset):
    """Rank ``rank``'s batches of a Criteo split, parsed with pyarrow (see the module docstring).

    Args:
        config: the files, table sizes, global batch size and ``on_bad_line`` policy.
        split: which of the config's splits.
        rank, world_size: this rank's place; ``global_batch_size`` must divide by ``world_size``.
        line_index: the split's ``LineIndex``; with more than one rank it is built here if not given
            (one rank needs none: it reads the files from the start).
        window_bytes: bytes of lines parsed per pyarrow call.
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
    ) -> None:
        self.start, self.stop = rank_slice(config.global_batch_size, rank, world_size)
        self.config, self.split, self.rank, self.world_size = config, split, rank, world_size
        self.paths = [str(p) for p in config.split_paths(split)]
        self.local_batch_size = self.stop - self.start
        self._sizes = config.feature_table_sizes()
        self.window_bytes = window_bytes
        if line_index is None and world_size > 1:
            line_index = LineIndex.build(self.paths)
        self.line_index = line_index
        self.skipped_lines = 0

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
            for line_number, data, lines in _file_windows(path, compressed, offset, number, skip, limit, self.window_bytes):
                yield path, line_number, data, lines
                if limit is not None:
                    limit -= lines
            if limit == 0:
                return

    def _parsed_windows(self, worker_id: int, num_workers: int, use_threads: bool) -> Iterator[tuple]:
        """Per window with some of this worker's lines: its pieces and their pyarrow parse (None: read them exactly).

        A piece is ``(first, end)`` window lines of one of this worker's batches; the batches are
        consecutive ``b`` lines of the rank's range.
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
            own_lines = sum(hi - lo for lo, hi in pieces)
            parsed = _arrow_parse(own, own_lines, self._sizes, use_threads)
            yield path, line_number, window_first, pieces, own, numbers, parsed

    def __iter__(self) -> Iterator[RecBatch]:
        worker = get_worker_info()
        worker_id, num_workers = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        use_threads = worker is None  # workers are processes already; pyarrow's threads are for one process
        b = self.local_batch_size
        self.skipped_lines = 0
        pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        tally: BadLineTally | None = None
        # Reading and parsing run a window ahead in a thread (pyarrow and zlib release the GIL);
        # the exact fallback, the bad-line policy and the batches stay in this one.
        for path, line_number, window_first, pieces, own, numbers, parsed in prefetch(
            self._parsed_windows(worker_id, num_workers, use_threads)
        ):
            if tally is None or tally.path != path:
                if tally is not None:
                    self.skipped_lines += tally.finish()
                tally = BadLineTally(path, self.config.on_bad_line)
            if parsed is None:
                if numbers is None:
                    numbers = np.arange(line_number, line_number + own.count(b"\n"))
                parsed = _python_parse(own, numbers, self._sizes, tally)
            at = 0
            for lo, hi in pieces:
                rows = parsed.rows(at, at + hi - lo)
                at += hi - lo
                pending.append((parsed.labels[rows], parsed.dense[rows], parsed.ids[:, rows]))
                if (window_first + hi) % b == 0:  # the batch's last line
                    yield self._batch(pending)
                    pending = []
        if tally is not None:
            self.skipped_lines += tally.finish()
        # A partial batch (pending) is dropped: with one rank it is the stream's last partial global batch.

    @staticmethod
    def _batch(pieces: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> RecBatch:
        if len(pieces) == 1:
            labels, dense, ids = pieces[0]
        else:
            labels = np.concatenate([p[0] for p in pieces])
            dense = np.concatenate([p[1] for p in pieces])
            ids = np.concatenate([p[2] for p in pieces], axis=1)
        return numpy_criteo_batch(labels, dense, ids)


def numpy_criteo_batch(labels: np.ndarray, dense: np.ndarray, ids: np.ndarray) -> RecBatch:
    """``criteo_batch`` from numpy arrays: the same tensors, with the KJT's per-key sums done in numpy.

    (No torch reductions: a batch costs a few numpy calls and zero-copy ``from_numpy``.)
    """
    present = ids >= 0
    lengths = present.reshape(-1).astype(np.int64)
    per_key = present.sum(axis=1)
    sparse = KeyedJaggedTensor(
        keys=CRITEO_FEATURE_NAMES,
        values=torch.from_numpy(ids[present]),
        lengths=torch.from_numpy(lengths),
        offsets=torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)])),
        stride=ids.shape[1],
        length_per_key=per_key.tolist(),
        offset_per_key=[0, *np.cumsum(per_key).tolist()],
    )
    return RecBatch(
        dense=torch.from_numpy(np.ascontiguousarray(dense)),
        sparse=sparse,
        labels=torch.from_numpy(np.ascontiguousarray(labels)),
    )
