"""Where a rank's Criteo lines are: files cut into byte chunks, their line counts, and windows of whole lines.

A split's files are read in order as one stream of lines. ``LineIndex`` counts the newlines (no
parsing) of each chunk of ``chunk_bytes`` of a plain file; a gzip file cannot be seeked and is one
chunk. From the counts any line of the stream maps to a chunk and a number of lines to pass over,
so a rank seeks to its first line and reads only its range; ``file_windows`` hands its lines on in
windows of whole lines, each with the file's 1-based number of its first line.
"""

from __future__ import annotations

import bisect
import gzip
import logging
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from lightning_recsys.data.readers import _GZIP_MAGIC, damaged_gzip_error

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 64 << 20  # plain-file bytes per line-count chunk


def count_byte(data: bytes, value: int) -> int:
    """How many times byte ``value`` occurs in ``data``: numpy counts about 4x faster than ``bytes.count``
    here and, unlike it, releases the GIL, so parse threads count side by side."""
    return int(np.count_nonzero(np.frombuffer(data, dtype=np.uint8) == value))


NEWLINE = 10


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
        with open_stream(chunk.path, True, 0) as stream:
            while block := stream.read(16 << 20):
                count += count_byte(block, NEWLINE)
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
            count += count_byte(block, NEWLINE)
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


class _GzipStream:
    """pyarrow's zlib stream (C++ that releases the GIL for a whole read, unlike Python's gzip); its errors name the file.

    pyarrow refuses zero padding after the last gzip member (tape or block-device padding), which
    ``gzip -d`` and Python's gzip skip, and loses the output of the read that reached it. On an error
    in a file that ends in a zero byte the rest is read with Python's gzip instead, which accepts
    exactly that padding and still refuses anything else (at the cost of decompressing the file twice).
    """

    def __init__(self, path: str) -> None:
        self.path, self._stream = path, pa.CompressedInputStream(pa.OSFile(path, "rb"), "gzip")
        self._returned = 0  # decompressed bytes handed out, where the fallback resumes
        self._fallback: gzip.GzipFile | None = None
        self._padding_logged = False

    def read(self, size: int) -> bytes:
        if self._fallback is None:
            try:
                block = self._stream.read(size)
            except (OSError, pa.ArrowException) as error:  # e.g. "Truncated compressed stream", without the path
                if not _ends_in_zero(self.path):  # cannot be padding: fail now, without a second pass
                    raise damaged_gzip_error(self.path, error) from error
                self._fallback = self._python_gzip(error)
            else:
                self._returned += len(block)
                return block
        try:
            block = self._fallback.read(size)
        except (EOFError, OSError, zlib.error) as error:
            raise damaged_gzip_error(self.path, error) from error
        if not block and size and not self._padding_logged:
            self._padding_logged = True
            log.info("%s: ignored the zero padding after its last gzip member, as gzip -d does.", self.path)
        return block

    def _python_gzip(self, error: BaseException) -> gzip.GzipFile:
        log.debug("%s: pyarrow stopped at decompressed byte %d (%s); reading on with Python's gzip.", self.path, self._returned, error)
        self._stream.close()
        fallback = gzip.open(self.path, "rb")  # noqa: SIM115 - closed in __exit__
        try:
            # pyarrow dropped the failing read's output: decompress again up to what was handed out.
            left = self._returned
            while left:
                skipped = len(fallback.read(min(left, 16 << 20)))
                if not skipped:
                    raise EOFError("the file ended before the data pyarrow had read")
                left -= skipped
        except (EOFError, OSError, zlib.error) as python_error:
            fallback.close()
            raise damaged_gzip_error(self.path, python_error) from error
        return fallback

    def __enter__(self) -> _GzipStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self._stream.close()
        if self._fallback is not None:
            self._fallback.close()


def _ends_in_zero(path: str) -> bool:
    with open(path, "rb") as raw:
        raw.seek(-1, os.SEEK_END)
        return raw.read(1) == b"\0"


def open_stream(path: str, compressed: bool, start: int):
    if compressed:
        if start:
            raise ValueError(f"{path} is gzip: it can only be read from its start.")
        return _GzipStream(path)
    raw = open(path, "rb")  # noqa: SIM115 - returned to the caller's with-block
    raw.seek(start)
    return raw


def file_windows(
    path: str, compressed: bool, start: int, line_number: int, skip: int, limit: int | None, window_bytes: int
) -> Iterator[tuple[int, bytes, int]]:
    """``(number of the first line, whole lines ending in newlines, how many)`` of ``path`` from byte ``start``.

    ``start`` is a line start, that of line ``line_number``; ``skip`` lines are passed over first
    (read, not parsed), and at most ``limit`` lines (``None``: all) are yielded.
    """
    with open_stream(path, compressed, start) as stream:
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
            lines = count_byte(window, NEWLINE)
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
