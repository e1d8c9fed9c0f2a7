"""TorchRec's preprocessed Criteo format, read with TorchRec's own utilities, each rank only its rows.

A directory holds three files per day ``i``: ``day_{i}_dense.npy``, ``day_{i}_sparse.npy`` and
``day_{i}_labels.npy``, as written by ``torchrec.datasets.criteo.BinaryCriteoUtils.tsv_to_npys``
(and TorchRec's ``npy_preproc_criteo.py`` script), the input of TorchRec's DLRM examples and the
MLPerf DLRM reference. ``convert_tsv_to_npy`` (``python -m lightning_recsys.data.criteo.to_npy``)
writes the same arrays from TSV or gzip files in bounded memory, with a progress bar.

What the files hold, and how it differs from the TSV readers (``CriteoDataModule``):

- ``dense`` float32 ``[N, 13]``: already transformed, ``ln(x - m + 2)`` where ``m`` is the smallest
  raw integer in that file, missing values counted as 0 (``tsv_to_npys`` does
  ``dense -= dense.min() - 2`` then ``np.log``). When the file's minimum is -1 that is
  ``log(x + 3)``, and a missing value is ``ln 3``. The TSV readers compute ``log(1 + max(x, 0))``
  and a missing value is 0. The batches carry the stored values unchanged.
- ``sparse`` int64 ``[N, 26]``: ``int(hex, 16)``, and a missing categorical is stored as **0**. The
  id is ``value % table_size``, so a missing value becomes id 0: a bag of one row that it shares
  with every value that is a multiple of the table size. The TSV readers give it an empty bag.
  Every bag here has exactly one id.
- ``labels`` int32 ``[N, 1]``; the batches carry them as float32 ``[B]``.

Ranks and workers: with ``N`` rows over a split's days (in the given order), global batch size
``B``, ``W`` ranks and ``b = B / W``, there are ``n = N // B`` global batches; rank ``r`` takes rows
``[r*n*b, (r+1)*n*b)`` (``BinaryCriteoUtils.get_file_row_ranges_and_remainder``), memory-maps
them with ``BinaryCriteoUtils.load_npy_range(..., mmap_mode=True)`` (only those pages are ever
read) and yields ``n`` batches of ``b`` rows. The last ``N - n*B`` rows are dropped, as the TSV
readers drop the partial global batch. DataLoader worker ``k`` of ``m`` builds batches
``k, k+m, ...``, so the order does not depend on ``num_workers``. Batches are built with numpy
slicing and ``%``, and ``torch.from_numpy``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchrec import KeyedJaggedTensor

from lightning_recsys.data.batch import RecBatch
from lightning_recsys.data.criteo.format import (
    _LINE,
    CRITEO_FEATURE_NAMES,
    NUM_CATEGORICAL_FEATURES,
    NUM_INTEGER_FEATURES,
    STAGE_SPLITS,
    CriteoFeatures,
    _diagnose,
)
from lightning_recsys.data.module import RankSlicedDataModule, Split
from lightning_recsys.data.ranks import even_rank_range
from lightning_recsys.data.readers import (
    BadLineTally,
    OnBadLine,
    check_global_batch_size,
    check_num_workers,
    check_on_bad_line,
    check_split_sources,
)

if TYPE_CHECKING:
    from lightning_recsys.data.criteo.parse import RawColumns

_KINDS = ("dense", "sparse", "labels")
_COLUMNS = {"dense": NUM_INTEGER_FEATURES, "sparse": NUM_CATEGORICAL_FEATURES, "labels": 1}


def _binary_utils():
    """TorchRec's ``BinaryCriteoUtils``, whose file access needs iopath (the ``criteo`` extra)."""
    try:
        import iopath  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "Reading TorchRec's npy Criteo files uses torchrec.datasets.criteo.BinaryCriteoUtils, which needs "
            "iopath: pip install 'lightning-recsys[criteo]' (or pip install iopath)."
        ) from error
    from torchrec.datasets.criteo import BinaryCriteoUtils

    return BinaryCriteoUtils


def day_file(path: str | Path, day: int, kind: str) -> str:
    """``<path>/day_<day>_<kind>.npy``, TorchRec's names."""
    return str(Path(path) / f"day_{day}_{kind}.npy")


@dataclass(kw_only=True)
class CriteoBinaryConfig:
    """Where the npy files are and how their values map to table rows.

    Args:
        path: the directory holding ``day_{i}_dense.npy``, ``day_{i}_sparse.npy``, ``day_{i}_labels.npy``.
        train_days, val_days, test_days: the day numbers of each split, read in the given order
            as one stream. An empty list is an empty split; at least one split needs a day.
        table_sizes: rows of each categorical feature's table: one int for all 26, or 26 ints.
            A stored value maps to ``value % table_size``.
        global_batch_size: examples per step across all ranks; it must be divisible by the world
            size. A split's final partial global batch is dropped (on every rank).
    """

    path: str
    train_days: list[int]
    val_days: list[int] = field(default_factory=list)
    test_days: list[int] = field(default_factory=list)
    table_sizes: int | list[int] = 100_000
    global_batch_size: int = 2048

    def __post_init__(self) -> None:
        if not str(self.path):
            raise ValueError("path='' must be the directory holding the day_{i}_{dense,sparse,labels}.npy files.")
        for name in ("train_days", "val_days", "test_days"):
            days = getattr(self, name)
            if not isinstance(days, (list, tuple)) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in days):
                raise ValueError(f"{name}={days!r} must be a list of day numbers (integers >= 0), e.g. [0, 1].")
        if not (self.train_days or self.val_days or self.test_days):
            raise ValueError("train_days, val_days and test_days are all empty; give at least one day.")
        check_split_sources({"train_days": self.train_days, "val_days": self.val_days, "test_days": self.test_days}, "day(s)")
        sizes = self.feature_table_sizes()
        if len(sizes) != NUM_CATEGORICAL_FEATURES or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(
                f"table_sizes={self.table_sizes!r} must be an integer >= 1, or a list of {NUM_CATEGORICAL_FEATURES} of them."
            )
        check_global_batch_size(self.global_batch_size)

    def feature_table_sizes(self) -> list[int]:
        if isinstance(self.table_sizes, (list, tuple)):
            return list(self.table_sizes)
        return [self.table_sizes] * NUM_CATEGORICAL_FEATURES

    def split_days(self, split: Split) -> list[int]:
        return list({"train": self.train_days, "val": self.val_days, "test": self.test_days}[split])


def check_day_files(config: CriteoBinaryConfig, split: Split) -> None:
    """Refuse a day of ``split`` whose npy files are not all in ``config.path``, naming the argument and the file."""
    name, days = f"{split}_days", config.split_days(split)
    for day in days:
        for kind in _KINDS:
            path = day_file(config.path, day, kind)
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"CriteoBinaryDataModule({name}={days!r}): {path} does not exist: path={config.path!r} needs "
                    f"day_{day}_dense.npy, day_{day}_sparse.npy and day_{day}_labels.npy for day {day} (convert TSV "
                    "files with python -m lightning_recsys.data.criteo.to_npy, or remove the day from "
                    f"{name})."
                )


class CriteoBinaryDataset(IterableDataset):
    """Rank ``rank``'s batches of a split of TorchRec-format npy files (see the module docstring)."""

    def __init__(self, config: CriteoBinaryConfig, split: Split, rank: int = 0, world_size: int = 1) -> None:
        start, stop = even_rank_range(config.global_batch_size, rank, world_size)
        self.config, self.split, self.rank, self.world_size = config, split, rank, world_size
        self.local_batch_size = stop - start
        self._sizes = np.asarray(config.feature_table_sizes(), dtype=np.int64)
        check_day_files(config, split)
        utils = _binary_utils()
        days = config.split_days(split)
        lengths = [self._rows(utils, day) for day in days]
        self.num_rows = sum(lengths)
        self.num_batches = self.num_rows // config.global_batch_size
        # Contiguous rows per rank: TorchRec's own partition of the first n * B rows.
        self._pieces: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        if self.num_batches:
            ranges, _ = utils.get_file_row_ranges_and_remainder(
                lengths=lengths, rank=rank, world_size=world_size, last_row=self.num_batches * config.global_batch_size - 1
            )
            for i, (first, last) in sorted(ranges.items()):
                if last < first:  # a day of 0 rows inside the range: TorchRec's load_npy_range refuses it
                    continue
                self._pieces.append(
                    tuple(
                        utils.load_npy_range(day_file(config.path, days[i], kind), first, last - first + 1, mmap_mode=True)
                        for kind in _KINDS
                    )
                )
        self._starts = np.cumsum([0] + [len(p[0]) for p in self._pieces])
        b = self.local_batch_size
        self._lengths = torch.ones(NUM_CATEGORICAL_FEATURES * b, dtype=torch.int64)
        self._offsets = torch.arange(NUM_CATEGORICAL_FEATURES * b + 1, dtype=torch.int64)

    def _rows(self, utils, day: int) -> int:
        shapes = {}
        for kind in _KINDS:
            shapes[kind] = tuple(utils.get_shape_from_npy(day_file(self.config.path, day, kind)))
        rows = shapes["dense"][0]
        if any(shape != (rows, _COLUMNS[kind]) for kind, shape in shapes.items()):
            raise ValueError(
                f"day {day} of {self.config.path}: shapes {shapes} are not (N, 13), (N, 26) and (N, 1) with one N."
            )
        return rows

    def __len__(self) -> int:
        return self.num_batches

    def _rows_of(self, first: int, end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This rank's rows ``[first, end)``, which may span two days."""
        i = int(np.searchsorted(self._starts, first, side="right")) - 1
        parts = []
        while first < end:
            dense, sparse, labels = self._pieces[i]
            lo, hi = first - self._starts[i], min(end, self._starts[i + 1]) - self._starts[i]
            parts.append((dense[lo:hi], sparse[lo:hi], labels[lo:hi]))
            first, i = self._starts[i] + hi, i + 1
        if len(parts) == 1:
            return parts[0]
        return tuple(np.concatenate([p[k] for p in parts]) for k in range(3))  # type: ignore[return-value]

    def batch(self, index: int) -> RecBatch:
        """This rank's batch ``index``."""
        b = self.local_batch_size
        dense, sparse, labels = self._rows_of(index * b, (index + 1) * b)
        ids = sparse % self._sizes  # [b, 26], read from the map here
        return RecBatch(
            dense=torch.from_numpy(np.array(dense, dtype=np.float32)),
            sparse=KeyedJaggedTensor(
                keys=CRITEO_FEATURE_NAMES,
                values=torch.from_numpy(np.ascontiguousarray(ids.T).reshape(-1)),  # feature-major
                lengths=self._lengths,
                offsets=self._offsets,
                stride=b,
                length_per_key=[b] * NUM_CATEGORICAL_FEATURES,
                offset_per_key=[b * i for i in range(NUM_CATEGORICAL_FEATURES + 1)],
            ),
            labels=torch.from_numpy(labels.reshape(-1).astype(np.float32)),
        )

    def __iter__(self) -> Iterator[RecBatch]:
        worker = get_worker_info()
        worker_id, num_workers = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        for index in range(worker_id, self.num_batches, num_workers):
            yield self.batch(index)


class CriteoBinaryDataModule(CriteoFeatures, RankSlicedDataModule):
    """TorchRec's npy Criteo files for any ranker; every rank memory-maps only its own rows.

    The arguments are ``CriteoBinaryConfig``'s, and ``num_workers`` (DataLoader worker processes;
    the batches do not depend on it). ``feature_names`` (``cat_0`` .. ``cat_25``, TorchRec's names
    too), ``table_sizes`` and ``num_dense_features`` describe the batches. Needs iopath
    (``pip install 'lightning-recsys[criteo]'``).
    """

    def __init__(
        self,
        path: str,
        train_days: list[int],
        val_days: list[int] | None = None,
        test_days: list[int] | None = None,
        table_sizes: int | list[int] = CriteoBinaryConfig.table_sizes,
        global_batch_size: int = CriteoBinaryConfig.global_batch_size,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.config = CriteoBinaryConfig(
            path=path, train_days=train_days, val_days=val_days or [], test_days=test_days or [], table_sizes=table_sizes,
            global_batch_size=global_batch_size,
        )
        check_num_workers(num_workers)
        self.num_workers = num_workers

    @classmethod
    def from_config(cls, config: CriteoBinaryConfig, num_workers: int = 0) -> CriteoBinaryDataModule:
        return cls(**dataclasses.asdict(config), num_workers=num_workers)

    def setup(self, stage: str | None = None) -> None:
        """Check the days of the splits ``stage`` reads, on every rank before anything is trained: the val
        loader is made when validation first runs (after a whole epoch with ``check_val_every_n_epoch=2``)."""
        for split in STAGE_SPLITS.get(stage, STAGE_SPLITS[None]):
            check_day_files(self.config, split)

    def _dataset(self, split: Split, rank: int, world_size: int) -> CriteoBinaryDataset:
        return CriteoBinaryDataset(self.config, split, rank, world_size)


# --------------------------------------------------------------------------- conversion from TSV


_INT32 = np.iinfo(np.int32)
_INT64_MAX = np.iinfo(np.int64).max


def _npy_range_problem(fields: list[str]) -> str | None:
    """What of a valid line the npy format cannot store (int32 integers, int64 categoricals); None if all fits."""
    for i, value in enumerate(fields[1 : 1 + NUM_INTEGER_FEATURES]):
        if value and not _INT32.min <= int(value) <= _INT32.max:
            return f"integer feature {i} (field {i + 2}) {value} is outside int32, the npy format's dense type"
    for i, value in enumerate(fields[1 + NUM_INTEGER_FEATURES :]):
        if value and int(value, 16) > _INT64_MAX:
            return (
                f"categorical feature cat_{i} (field {i + 2 + NUM_INTEGER_FEATURES}) {value!r} is outside int64, "
                "the npy format's sparse type"
            )
    return None


def _python_raw(data: bytes, first_line: int, tally: BadLineTally) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(labels, integers, hex values)`` of the valid lines of ``data``, by the line-by-line reader's rules.

    A line the npy format cannot store (a value too wide for its dtype) is bad too: stored, it would wrap around.
    """
    labels, integers, values = [], [], []
    for i, line in enumerate(data.decode("utf-8", errors="replace").split("\n")[:-1]):
        line = line.rstrip("\r\n")
        if _LINE.fullmatch(line) is None:
            tally.bad(first_line + i, line, _diagnose(line))
            continue
        fields = line.split("\t")
        if (problem := _npy_range_problem(fields)) is not None:
            tally.bad(first_line + i, line, problem)
            continue
        labels.append(int(fields[0]))
        integers.append([int(x or "0") for x in fields[1 : 1 + NUM_INTEGER_FEATURES]])
        values.append([int(x or "0", 16) for x in fields[1 + NUM_INTEGER_FEATURES :]])
    return (
        np.asarray(labels, dtype=np.int32).reshape(-1, 1),
        np.asarray(integers, dtype=np.int32).reshape(-1, NUM_INTEGER_FEATURES),
        np.asarray(values, dtype=np.int64).reshape(-1, NUM_CATEGORICAL_FEATURES),
    )


def _fits_npy(raw: RawColumns) -> bool:
    """Whether pyarrow's columns fit the npy dtypes (int32 integers, int64 categoricals) without wrapping."""
    integers = raw.integers
    return bool(
        (integers.size == 0 or (integers.min() >= _INT32.min and integers.max() <= _INT32.max))
        and (raw.hex_values.size == 0 or raw.hex_values.max() <= np.uint64(_INT64_MAX))
    )


def _write_npy(name: str, dtype: np.dtype, columns: int, rows: int, body: str, transform=None) -> None:
    """An npy file of ``[rows, columns]`` whose data is the raw ``body`` file, optionally transformed chunk-wise."""
    with open(name, "wb") as out, open(body, "rb") as raw:
        np.lib.format.write_array_header_1_0(
            out, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": (rows, columns)}
        )
        if transform is None:
            shutil.copyfileobj(raw, out, 16 << 20)
            return
        while chunk := raw.read(columns * 4 * 65536):
            out.write(transform(np.frombuffer(chunk, dtype=np.int32)).tobytes())


def input_file_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be read as an input file (``"does not exist"``, ``"is not a file"``), or None."""
    if os.path.isfile(path):
        return None
    return "is not a file" if os.path.exists(path) else "does not exist"


def convert_tsv_to_npy(
    in_path: str,
    out_dir: str,
    day: int,
    *,
    on_bad_line: OnBadLine = "error",
    progress: bool = True,
    window_bytes: int = 16 << 20,
) -> int:
    """Write ``day_{day}_{dense,sparse,labels}.npy`` for one TSV or gzip file; returns the rows written.

    The arrays are those of TorchRec's ``BinaryCriteoUtils.tsv_to_npys`` (same dtypes, shapes and
    values, including the dense ``ln(x - min + 2)``), but the file is parsed by pyarrow in windows
    and spooled to disk, so memory stays bounded, and gzip is read directly. Malformed lines are
    handled as by the TSV readers (``on_bad_line``), where ``tsv_to_npys`` would raise or
    misread them; so is a line with a value the dtypes cannot hold (an integer outside int32, a
    categorical above 2^63 - 1), which would otherwise wrap around. ``x - min + 2`` is computed in
    int64, where ``tsv_to_npys``' int32 wraps past 2^31 - 1 (a NaN dense).
    """
    from tqdm import tqdm

    from lightning_recsys.data.criteo.parse import arrow_raw_columns
    from lightning_recsys.data.criteo.ranges import file_windows, is_gzip

    check_on_bad_line(on_bad_line)
    if (problem := input_file_problem(in_path)) is not None:
        raise FileNotFoundError(f"{in_path} {problem}: convert_tsv_to_npy needs a Criteo TSV or gzip file.")
    os.makedirs(out_dir, exist_ok=True)
    compressed = is_gzip(in_path)
    tally = BadLineTally(str(in_path), on_bad_line)
    rows, low = 0, None
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".convert-") as tmp:
        bodies = {kind: os.path.join(tmp, kind) for kind in _KINDS}
        files = {kind: open(name, "wb") for kind, name in bodies.items()}  # noqa: SIM115 - closed below
        bar = tqdm(
            total=None if compressed else os.path.getsize(in_path), unit="B", unit_scale=True, disable=not progress,
            desc=f"{Path(in_path).name} -> day_{day}", file=sys.stderr,
        )
        try:
            for line_number, data, lines in file_windows(str(in_path), compressed, 0, 1, 0, None, window_bytes):
                raw = arrow_raw_columns(data, lines, use_threads=True)  # one window at a time: pyarrow's pool parses it
                if raw is not None and not _fits_npy(raw):
                    raw = None  # the exact path names the line whose value the npy dtypes cannot hold
                if raw is None:
                    labels, integers, values = _python_raw(data, line_number, tally)
                else:
                    labels = raw.positive.astype(np.int32).reshape(-1, 1)
                    integers = raw.integers.astype(np.int32)  # tsv_to_npys keeps int32 too
                    values = raw.hex_values.T.astype(np.int64)
                if len(labels):
                    low = int(integers.min()) if low is None else min(low, int(integers.min()))
                files["dense"].write(np.ascontiguousarray(integers).tobytes())
                files["sparse"].write(np.ascontiguousarray(values).tobytes())
                files["labels"].write(labels.tobytes())
                rows += len(labels)
                bar.update(len(data))
                bar.set_postfix(lines=line_number + lines - 1, refresh=False)
        finally:
            bar.close()
            for f in files.values():
                f.close()
        tally.finish()
        # tsv_to_npys: dense -= dense.min() - 2; dense = np.log(dense, dtype=np.float32). In int64 here: x - min + 2
        # reaches 2^32 + 1 (int32 wrapped an integer near 2^31 - 1 to a negative, a NaN dense, and a minimum
        # of -2^31 made the shift itself overflow); values that fit int32 come out exactly as tsv_to_npys' do.
        shift = np.int64(0 if low is None else low - 2)
        _write_npy(day_file(out_dir, day, "dense"), np.float32, NUM_INTEGER_FEATURES, rows, bodies["dense"],
                   transform=lambda x: np.log(x.astype(np.int64) - shift, dtype=np.float32))
        _write_npy(day_file(out_dir, day, "sparse"), np.int64, NUM_CATEGORICAL_FEATURES, rows, bodies["sparse"])
        _write_npy(day_file(out_dir, day, "labels"), np.int32, 1, rows, bodies["labels"])
    return rows
