"""Windows of whole Criteo TSV lines into columns: pyarrow's C++ CSV reader, vectorized checks and hex decoding.

``arrow_raw_columns`` parses a window of lines into ``RawColumns`` (labels, integers, hex values)
or returns None when any line of it might be malformed; the caller then reads that window by the
exact line-by-line rules (``python_parse``), which raise or skip with the line's number. Two
pyarrow paths, tried in turn:

- **fixed width** (the released files): a label of 1 byte and categoricals of exactly 8 bytes or
  empty, read by pyarrow as ``fixed_size_binary`` so their bytes lie at fixed strides; all 26
  columns are decoded from 8-byte words with a few integer operations each. pyarrow refuses a
  window with any other length, which goes to:
- **any width**: categoricals as variable-length binary, up to 16 hex digits each.

Both accept a window only after checks that together equal the line regular expression of
``lightning_recsys.data.criteo.format``: only the bytes ``[0-9a-fA-F]``, ``-``, tab and newline occur
(``bytes.translate``); pyarrow finds 40 fields on every line and reads the 13 integer columns as
int64 (``-?[0-9]+`` or empty, else it raises); the label is ``0`` or ``1``; and a categorical holds
hex digits only. In the fixed-width path that last check is a count: every ``-`` of the window must
be the sign of a negative integer (a ``-0`` fails it and takes the exact path, which is correct).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pa_compute
import pyarrow.csv as pa_csv
import torch
from torchrec import KeyedJaggedTensor

from lightning_recsys.data.batch import RecBatch
from lightning_recsys.data.criteo.format import (
    _LINE,
    _NUM_FIELDS,
    CRITEO_FEATURE_NAMES,
    NUM_CATEGORICAL_FEATURES,
    NUM_INTEGER_FEATURES,
    _diagnose,
)
from lightning_recsys.data.criteo.ranges import count_byte
from lightning_recsys.data.readers import BadLineTally

_FIRST_CATEGORICAL = 1 + NUM_INTEGER_FEATURES
_DASH = ord("-")
_MAX_HEX_DIGITS = 16  # longer values (never in the released files) take the exact Python path
_BLOCK_BYTES = 1 << 20  # pyarrow's parse block when it uses its own threads

# Bytes a valid window can hold; anything else (\r, spaces, "+", "x", non-ASCII) sends it to the exact path.
_ALLOWED = b"0123456789abcdefABCDEF-\t\n"
_COLUMNS = [str(i) for i in range(_NUM_FIELDS)]
_PARSE = pa_csv.ParseOptions(
    delimiter="\t", quote_char=False, escape_char=False, double_quote=False, newlines_in_values=False,
    ignore_empty_lines=False,
)


def _convert_options(label: pa.DataType, categorical: pa.DataType) -> pa_csv.ConvertOptions:
    types = [label] + [pa.int64()] * NUM_INTEGER_FEATURES + [categorical] * NUM_CATEGORICAL_FEATURES
    return pa_csv.ConvertOptions(
        column_types=dict(zip(_COLUMNS, types)),
        null_values=[""],  # a missing integer or fixed-width categorical; binary columns keep "" (strings_can_be_null=False)
        strings_can_be_null=False,
        quoted_strings_can_be_null=False,
    )


_CONVERT_FIXED = _convert_options(pa.binary(1), pa.binary(8))
_CONVERT_ANY = _convert_options(pa.binary(), pa.binary())

_NIBBLE = np.full(256, 255, dtype=np.uint8)  # ASCII hex digit -> value; 255 marks a non-digit
for _i, _c in enumerate(b"0123456789abcdef"):
    _NIBBLE[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _NIBBLE[_c] = 10 + _i
_U64 = np.uint64
_LOW_NIBBLES, _BIT0 = _U64(0x0F0F0F0F0F0F0F0F), _U64(0x0101010101010101)
_LANES16, _LANES32 = _U64(0x00FF00FF00FF00FF), _U64(0xFFFF0000FFFF0000)


@dataclass
class RawColumns:
    """Lines as the files hold them: labels, integers (missing: 0) and hex values (missing: 0, ``present`` False)."""

    positive: np.ndarray  # [n] bool
    integers: np.ndarray  # [n, 13] int64
    hex_values: np.ndarray  # [26, n] uint64
    present: np.ndarray  # [26, n] bool


def arrow_raw_columns(data: bytes, lines: int, use_threads: bool = False) -> RawColumns | None:
    """Every line of ``data`` (whole lines) parsed by pyarrow, or None if any line might be malformed.

    ``use_threads``: pyarrow parses blocks of the window on its CPU pool; otherwise the window is one
    block in this thread (the dataset runs windows in parallel threads instead).
    """
    if b"\r" in data:
        # CRLF lines (files written on Windows): the line-by-line rules strip a line's trailing "\r",
        # so pyarrow may read them without it; every window went to the ~6x slower exact path before.
        # A "\r" anywhere else stays and still sends the window there.
        data = data.replace(b"\r\n", b"\n")
    if data.translate(None, _ALLOWED):
        return None
    table = _read(data, lines, _CONVERT_FIXED, use_threads)
    if table is not None:
        raw = _fixed_width_columns(table, lines, count_byte(data, _DASH))
        if raw is not None:
            return raw
    table = _read(data, lines, _CONVERT_ANY, use_threads)
    return None if table is None else _any_width_columns(table, lines)


def _read(data: bytes, lines: int, convert: pa_csv.ConvertOptions, use_threads: bool) -> pa.Table | None:
    try:
        table = pa_csv.read_csv(
            pa.py_buffer(data),
            read_options=pa_csv.ReadOptions(
                use_threads=use_threads,
                block_size=_BLOCK_BYTES if use_threads else max(len(data), 1),
                column_names=_COLUMNS,
            ),
            parse_options=_PARSE,
            convert_options=convert,
        )
    except pa.ArrowInvalid:  # a wrong field count, a field of the wrong width, or an integer that is not -?[0-9]+
        return None
    return table if table.num_rows == lines else None


def _array(table: pa.Table, column: int) -> pa.Array:
    chunked = table.column(column)
    return chunked.chunks[0] if chunked.num_chunks == 1 else chunked.combine_chunks()


def _integers(table: pa.Table, lines: int) -> np.ndarray:
    integers = np.empty((lines, NUM_INTEGER_FEATURES), dtype=np.int64)
    for i in range(NUM_INTEGER_FEATURES):
        integers[:, i] = pa_compute.fill_null(table.column(1 + i), 0).to_numpy()
    return integers


def _fixed_width_columns(table: pa.Table, lines: int, dashes: int) -> RawColumns | None:
    label = _array(table, 0)
    label_bytes = np.frombuffer(label.buffers()[1], dtype=np.uint8, count=lines, offset=label.offset)
    positive = label_bytes == ord("1")
    if label.null_count or not (positive | (label_bytes == ord("0"))).all():
        return None
    integers = _integers(table, lines)
    if np.count_nonzero(integers < 0) != dashes:  # a "-" in a categorical (or a "-0")
        return None
    hex_values = np.empty((NUM_CATEGORICAL_FEATURES, lines), dtype=_U64)
    present = np.empty((NUM_CATEGORICAL_FEATURES, lines), dtype=bool)
    scratch = np.empty(lines, dtype=_U64)
    for f in range(NUM_CATEGORICAL_FEATURES):
        column = _array(table, _FIRST_CATEGORICAL + f)
        words = np.frombuffer(column.buffers()[1], dtype="<u8", count=lines, offset=column.offset * 8)
        # A value is 8 ASCII bytes, never a zero word; pyarrow zero-fills a missing one (checked by the count).
        np.not_equal(words, 0, out=present[f])
        if lines - np.count_nonzero(present[f]) != column.null_count:
            return None
        hex8_words(words, hex_values[f], scratch)
    return RawColumns(positive=positive, integers=integers, hex_values=hex_values, present=present)


def hex8_words(words: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> None:
    """``int(w, 16)`` of little-endian uint64 words of 8 ASCII hex digits each (a zero word gives 0), into ``out``.

    Byte ``i`` of a word is digit ``i``. A digit's value is its low nibble, plus 9 for a letter (bit 6
    set); then three multiply-shift steps merge neighbouring nibbles, bytes and 16-bit halves.
    """
    np.right_shift(words, _U64(6), out=scratch)
    scratch &= _BIT0
    scratch *= _U64(9)
    np.bitwise_and(words, _LOW_NIBBLES, out=out)
    out += scratch  # byte i: digit i's value
    out *= _U64(0x1001)  # byte 2k+1 += byte 2k << 4
    out >>= _U64(8)
    out &= _LANES16  # 16-bit lane k: byte k of the big-endian value
    out *= _U64(0x1000001)  # 32-bit lane j, bits 16-31: bytes 2j, 2j+1
    out &= _LANES32
    out >>= _U64(16)
    out *= _U64(0x1000000000001)  # bits 32-63: the two 16-bit halves
    out >>= _U64(32)


def _any_width_columns(table: pa.Table, lines: int) -> RawColumns | None:
    label = _array(table, 0)
    offsets = np.frombuffer(label.buffers()[1], dtype=np.int32, count=lines + 1, offset=label.offset * 4)
    if lines and (offsets[-1] - offsets[0] != lines or (np.diff(offsets) != 1).any()):
        return None
    label_bytes = np.frombuffer(label.buffers()[2], dtype=np.uint8, count=lines, offset=int(offsets[0]))
    positive = label_bytes == ord("1")
    if not (positive | (label_bytes == ord("0"))).all():
        return None
    hex_values = np.empty((NUM_CATEGORICAL_FEATURES, lines), dtype=_U64)
    present = np.empty((NUM_CATEGORICAL_FEATURES, lines), dtype=bool)
    for f in range(NUM_CATEGORICAL_FEATURES):
        if not _hex_values(_array(table, _FIRST_CATEGORICAL + f), hex_values[f], present[f]):
            return None
    return RawColumns(positive=positive, integers=_integers(table, lines), hex_values=hex_values, present=present)


def _hex_values(column: pa.Array, values: np.ndarray, present: np.ndarray) -> bool:
    """Writes ``int(value, 16)`` and whether the value is there into the rows' slots; False if one is not hex."""
    k = len(column)
    offsets = np.frombuffer(column.buffers()[1], dtype=np.int32, count=k + 1, offset=column.offset * 4)
    lengths = np.diff(offsets)
    np.greater(lengths, 0, out=present)
    values.fill(0)
    if not present.any():
        return True
    if lengths.max() > _MAX_HEX_DIGITS:
        return False
    data = np.frombuffer(column.buffers()[2], dtype=np.uint8, count=int(offsets[-1] - offsets[0]), offset=int(offsets[0]))
    digits = _NIBBLE[data]
    if (digits == 255).any():
        return False
    row = np.repeat(np.arange(k), lengths)
    ends = (offsets[1:] - offsets[0])[row]
    shifts = (4 * (ends - 1 - np.arange(len(data)))).astype(_U64)
    starts = (offsets[:-1] - offsets[0])[present]
    values[present] = np.bitwise_or.reduceat(digits.astype(_U64) << shifts, starts)
    return True


_LOG_TABLE_SIZE = 1 << 20
_log_table: np.ndarray | None = None


def dense_values(integers: np.ndarray) -> np.ndarray:
    """``dense_transform`` of int64 integers: looked up below 2^20 (a table made by it), computed above."""
    global _log_table
    if _log_table is None:
        _log_table = dense_transform(torch.arange(_LOG_TABLE_SIZE, dtype=torch.float64)).numpy()
    dense = _log_table[np.clip(integers, 0, _LOG_TABLE_SIZE - 1)]
    large = integers >= _LOG_TABLE_SIZE
    if large.any():
        dense[large] = dense_transform(torch.from_numpy(integers[large].astype(np.float64))).numpy()
    return dense


@dataclass
class Parsed:
    """Parsed lines: labels ``[n]``, dense ``[n, 13]``, ids and ``present`` ``[26, n]`` of the valid ones.

    ``valid`` says which of the window's lines they are (None: every line); an id where ``present``
    is False is meaningless.
    """

    labels: np.ndarray
    dense: np.ndarray
    ids: np.ndarray
    present: np.ndarray
    valid: np.ndarray | None = None

    def rows(self, first_line: int, end_line: int) -> slice:
        """The rows of the window's lines ``[first_line, end_line)``."""
        if self.valid is None:
            return slice(first_line, end_line)
        if not hasattr(self, "_row_at"):
            self._row_at = np.concatenate([[0], np.cumsum(self.valid)])
        return slice(int(self._row_at[first_line]), int(self._row_at[end_line]))


def arrow_parse(data: bytes, lines: int, sizes: list[int], use_threads: bool = False) -> Parsed | None:
    """The features of every line of ``data``, or None if a line might be malformed (see the module docstring)."""
    raw = arrow_raw_columns(data, lines, use_threads)
    if raw is None:
        return None
    ids = np.empty((NUM_CATEGORICAL_FEATURES, lines), dtype=np.int64)
    for f, size in enumerate(sizes):
        np.remainder(raw.hex_values[f], _U64(size), out=ids[f].view(_U64))  # < 2^64 / 2: a valid int64
    return Parsed(labels=raw.positive.astype(np.float32), dense=dense_values(raw.integers), ids=ids, present=raw.present)


def python_parse(data: bytes, line_numbers: np.ndarray, sizes: list[int], tally: BadLineTally) -> Parsed:
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
    ids = ids.numpy()
    return Parsed(labels=labels.numpy(), dense=dense.numpy(), ids=ids, present=ids >= 0, valid=valid)


def parse_criteo_rows(rows: list[list[str]], table_sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Labels ``[B]``, dense ``[B, 13]`` and ids ``[26, B]`` (-1: missing) of checked lines split at tabs."""
    labels = torch.tensor([row[0] == "1" for row in rows], dtype=torch.float32)
    # float64 first: raw counts can exceed float32's exact range before the log shrinks them.
    integers = torch.tensor(
        [[float(x) if x else 0.0 for x in row[1 : 1 + NUM_INTEGER_FEATURES]] for row in rows], dtype=torch.float64
    ).reshape(len(rows), NUM_INTEGER_FEATURES)
    ids = torch.tensor(
        [[int(x, 16) % size if x else -1 for x, size in zip(row[1 + NUM_INTEGER_FEATURES :], table_sizes)] for row in rows],
        dtype=torch.long,
    ).reshape(len(rows), NUM_CATEGORICAL_FEATURES).T  # [26, B]: a KJT is feature-major
    return labels, dense_transform(integers), ids


def dense_transform(integers: torch.Tensor) -> torch.Tensor:
    """``log(1 + max(x, 0))`` of float64 raw integer features (missing already 0), as float32."""
    return torch.log1p(integers.clamp_(min=0.0)).to(torch.float32)


def criteo_batch(labels: torch.Tensor, dense: torch.Tensor, ids: torch.Tensor) -> RecBatch:
    """The ``RecBatch`` of labels ``[B]``, dense ``[B, 13]`` and ids ``[26, B]``, where -1 is an empty bag."""
    present = ids >= 0
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=CRITEO_FEATURE_NAMES, values=ids[present], lengths=present.reshape(-1).long()
    )
    return RecBatch(dense=dense, sparse=sparse, labels=labels)
