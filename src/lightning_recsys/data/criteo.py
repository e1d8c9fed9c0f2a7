"""Criteo Kaggle / Terabyte click logs (TSV, plain or gzip), streamed line by line and sharded across ranks.

Each line is ``label \\t I1 .. I13 \\t C1 .. C26``: a 0/1 label, 13 integer features and 26
categorical features written as hexadecimal strings (8 digits in the released files). Any feature
may be empty (missing). Features of an example:

- dense ``[B, 13]`` float32: ``log(1 + max(x, 0))`` of each integer feature; a missing value is 0,
  and so is a negative one (only a few columns have them, down to -3, and the log needs ``x >= 0``).
- sparse: one key per categorical feature, ``cat_0 .. cat_25``. The hex string is read as an
  integer and reduced modulo the feature's table size (``int(value, 16) % table_size``). A missing
  value is an empty bag (length 0), so its pooled embedding is zero rather than some real row's.
- labels ``[B]`` float32.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from torch.utils.data import get_worker_info
from torchrec import KeyedJaggedTensor

from lightning_recsys.data.batch import RecBatch
from lightning_recsys.data.module import RankSlicedDataModule, Split
from lightning_recsys.data.readers import (
    BadLineTally,
    GlobalBatchDataset,
    OnBadLine,
    check_global_batch_size,
    check_num_workers,
    check_on_bad_line,
    check_split_sources,
    iter_lines,
    normalized_path,
)

if TYPE_CHECKING:
    from lightning_recsys.data.criteo_ranges import LineIndex

CriteoReader = Literal["arrow", "python"]
CRITEO_READERS: tuple[str, ...] = ("arrow", "python")

NUM_INTEGER_FEATURES = 13
NUM_CATEGORICAL_FEATURES = 26
CRITEO_FEATURE_NAMES: list[str] = [f"cat_{i}" for i in range(NUM_CATEGORICAL_FEATURES)]
_NUM_FIELDS = 1 + NUM_INTEGER_FEATURES + NUM_CATEGORICAL_FEATURES

# One regular expression checks a whole line in C; the per-field diagnosis runs only for bad lines.
_LINE = re.compile(r"[01]\t(?:(?:-?[0-9]+)?\t){13}(?:[0-9a-fA-F]*\t){25}[0-9a-fA-F]*")
_INTEGER = re.compile(r"(?:-?[0-9]+)?")
_HEX = re.compile(r"[0-9a-fA-F]*")


@dataclass(kw_only=True)
class CriteoConfig:
    """Where the Criteo TSV files are and how their categorical values map to table rows.

    Args:
        train_paths, val_paths, test_paths: the files of each split (plain text or gzip, detected
            by content). A split's files are read in the given order as one stream; an empty list
            is an empty split. At least one split needs a file.
        table_sizes: rows of each categorical feature's table: one int for all 26, or 26 ints.
            Values are reduced modulo the size, so a smaller table means more collisions.
        global_batch_size: examples per step across all ranks; it must be divisible by the world
            size. A split's final partial global batch is dropped (on every rank).
        on_bad_line: ``"error"`` raises ``MalformedLineError`` (file, line number, line, problem);
            ``"skip"`` skips the line, counts it, and logs one warning per file.
        reader: ``"arrow"`` parses with pyarrow, each rank reading only its own contiguous lines
            (``lightning_recsys.data.criteo_arrow``); ``"python"`` is the line-by-line
            ``CriteoDataset``, where every rank reads every line and takes its slice of each
            global batch. With one rank both give the same batches (but for ``on_bad_line="skip"``,
            where the arrow reader's batch holding a skipped line is one example short).
    """

    train_paths: list[str]
    val_paths: list[str] = field(default_factory=list)
    test_paths: list[str] = field(default_factory=list)
    table_sizes: int | list[int] = 100_000
    global_batch_size: int = 2048
    on_bad_line: OnBadLine = "error"
    reader: CriteoReader = "arrow"

    def __post_init__(self) -> None:
        if self.reader not in CRITEO_READERS:
            raise ValueError(f"reader={self.reader!r} is not one of {list(CRITEO_READERS)}.")
        for name in ("train_paths", "val_paths", "test_paths"):
            paths = getattr(self, name)
            if isinstance(paths, (str, Path)) or not isinstance(paths, (list, tuple)):
                raise ValueError(f"{name}={paths!r} must be a list of file paths; for one file write [{str(paths)!r}].")
            if any(not str(path) for path in paths):
                raise ValueError(f"{name}={paths!r} contains an empty path.")
        if not (self.train_paths or self.val_paths or self.test_paths):
            raise ValueError("train_paths, val_paths and test_paths are all empty; give at least one file.")
        check_split_sources(
            {"train_paths": self.train_paths, "val_paths": self.val_paths, "test_paths": self.test_paths}, "file(s)", normalized_path
        )
        sizes = self.feature_table_sizes()
        if len(sizes) != NUM_CATEGORICAL_FEATURES:
            raise ValueError(
                f"table_sizes has {len(sizes)} entries; give one size for all {NUM_CATEGORICAL_FEATURES} "
                f"categorical features, or {NUM_CATEGORICAL_FEATURES} sizes."
            )
        if any(isinstance(size, bool) or not isinstance(size, int) or size < 1 for size in sizes):
            raise ValueError(f"table_sizes={self.table_sizes!r} must be an integer >= 1, or a list of them.")
        check_global_batch_size(self.global_batch_size)
        check_on_bad_line(self.on_bad_line)

    def feature_table_sizes(self) -> list[int]:
        """Rows of each table, in ``CRITEO_FEATURE_NAMES`` order."""
        if isinstance(self.table_sizes, (list, tuple)):
            return list(self.table_sizes)
        return [self.table_sizes] * NUM_CATEGORICAL_FEATURES

    def split_paths(self, split: Split) -> list[str]:
        return {"train": self.train_paths, "val": self.val_paths, "test": self.test_paths}[split]


# The splits each Lightning stage reads (``predict`` reads the test split); None: every split.
STAGE_SPLITS: dict[str | None, tuple[Split, ...]] = {
    "fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("test",), None: ("train", "val", "test"),
}


def check_split_files(config: CriteoConfig, split: Split) -> None:
    """Refuse a file of ``split`` that is missing (or a directory), naming the argument and its position.

    The files were first opened when the split was read: a typo in ``val_paths`` then failed after a
    whole training epoch (reader="python", or one arrow rank), with a message that named no argument.
    """
    name = f"{split}_paths"
    for i, path in enumerate(config.split_paths(split)):
        if not os.path.isfile(path):
            what = "is not a file" if os.path.exists(path) else "does not exist"
            raise FileNotFoundError(
                f"CriteoDataModule({name}=...): {name}[{i}]={str(path)!r} {what}. The {split} split reads every file of "
                f"{name} in order; fix the path or remove it from {name}."
            )


def _diagnose(line: str) -> str:
    """What is wrong with a line that failed ``_LINE``, field by field."""
    fields = line.split("\t")
    if len(fields) != _NUM_FIELDS:
        hint = " (39 is the unlabeled Kaggle test.txt layout, which has no label to train or test on)"
        return (
            f"expected {_NUM_FIELDS} tab-separated fields (label, {NUM_INTEGER_FEATURES} integer and "
            f"{NUM_CATEGORICAL_FEATURES} categorical features), found {len(fields)}"
            + (hint if len(fields) == _NUM_FIELDS - 1 else "")
        )
    if fields[0] not in ("0", "1"):
        return f"label {fields[0]!r} (field 1) is not 0 or 1"
    for i, value in enumerate(fields[1 : 1 + NUM_INTEGER_FEATURES]):
        if not _INTEGER.fullmatch(value):
            return f"integer feature {i} (field {i + 2}) {value!r} is not an integer"
    for i, value in enumerate(fields[1 + NUM_INTEGER_FEATURES :]):
        if not _HEX.fullmatch(value):
            return f"categorical feature cat_{i} (field {i + 2 + NUM_INTEGER_FEATURES}) {value!r} is not hexadecimal"
    return "the line does not match the Criteo layout"  # not reached: the checks above cover _LINE


class CriteoDataset(GlobalBatchDataset[str]):
    """Rank ``rank``'s slice of every global batch of a Criteo split, read line by line.

    Every rank reads and checks every line of the split's files (in order, as one stream) and
    parses only its own slice. The final partial global batch is dropped on every rank.
    ``skipped_lines`` counts the lines skipped by the last (or current) pass; with DataLoader workers
    the main process's dataset has the count too (worker 0's: every worker reads every line).
    """

    def __init__(self, config: CriteoConfig, split: Split, rank: int = 0, world_size: int = 1) -> None:
        super().__init__(global_batch_size=config.global_batch_size, rank=rank, world_size=world_size)
        self.config, self.split = config, split
        self.paths = config.split_paths(split)
        check_split_files(config, split)
        self._sizes = config.feature_table_sizes()

    def _records(self, warn: bool) -> Iterator[str]:
        self._skipped.start_pass()
        worker = get_worker_info()
        counts = worker is None or worker.id == 0  # every worker skips the same lines: one counts them
        for path in self.paths:
            tally = BadLineTally(str(path), self.config.on_bad_line, warn=warn)
            for line_number, line in iter_lines(path):
                if _LINE.fullmatch(line) is None:
                    tally.bad(line_number, line, _diagnose(line))
                    continue
                yield line
            skipped = tally.finish()
            if counts:
                self._skipped.add(skipped)

    def _collate(self, records: list[str]) -> RecBatch:
        return criteo_batch(*parse_criteo_rows([line.split("\t") for line in records], self._sizes))


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


class CriteoFeatures:
    """What a model needs from a Criteo DataModule (``config.feature_table_sizes()`` gives the tables)."""

    config: CriteoConfig

    @property
    def feature_names(self) -> list[str]:
        return list(CRITEO_FEATURE_NAMES)

    @property
    def table_sizes(self) -> list[int]:
        return self.config.feature_table_sizes()

    @property
    def num_dense_features(self) -> int:
        return NUM_INTEGER_FEATURES


class CriteoDataModule(CriteoFeatures, RankSlicedDataModule):
    """Criteo Kaggle / Terabyte TSV files for any ranker; every rank gets its own slice of each global batch.

    The arguments are ``CriteoConfig``'s (flat, so the CLI takes ``--data.train_paths [...]``), and
    ``num_workers``, the DataLoader's worker processes (they split a rank's batches; the batches
    do not depend on it). ``feature_names``, ``table_sizes`` and ``num_dense_features`` describe the
    batches, e.g. ``DLRMRanker(table_sizes=dm.table_sizes, num_dense_features=dm.num_dense_features,
    feature_names=dm.feature_names)``. Batches come in file order (no shuffling).

    With the arrow reader and more than one rank, each rank needs the split's line count to find
    its range: the ranks count the newlines of a share of the files' chunks each and sum the counts
    (one all-reduce), once per split.
    """

    def __init__(
        self,
        train_paths: list[str],
        val_paths: list[str] | None = None,
        test_paths: list[str] | None = None,
        table_sizes: int | list[int] = CriteoConfig.table_sizes,
        global_batch_size: int = CriteoConfig.global_batch_size,
        on_bad_line: OnBadLine = CriteoConfig.on_bad_line,
        reader: CriteoReader = CriteoConfig.reader,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.config = CriteoConfig(
            train_paths=train_paths, val_paths=val_paths or [], test_paths=test_paths or [], table_sizes=table_sizes,
            global_batch_size=global_batch_size, on_bad_line=on_bad_line, reader=reader,
        )
        check_num_workers(num_workers)
        self.num_workers = num_workers
        self._line_indexes: dict[Split, LineIndex] = {}

    @classmethod
    def from_config(cls, config: CriteoConfig) -> CriteoDataModule:
        return cls(**dataclasses.asdict(config))

    def setup(self, stage: str | None = None) -> None:
        """Check that the files of the splits ``stage`` reads exist, on every rank before anything is trained."""
        for split in STAGE_SPLITS.get(stage, STAGE_SPLITS[None]):
            check_split_files(self.config, split)

    def _dataset(self, split: Split, rank: int, world_size: int):
        if self.config.reader == "python":
            return CriteoDataset(self.config, split, rank, world_size)
        from lightning_recsys.data.criteo_arrow import CriteoArrowDataset

        index = self.line_index(split, rank, world_size) if world_size > 1 else None
        return CriteoArrowDataset(self.config, split, rank, world_size, line_index=index)

    def line_index(self, split: Split, rank: int = 0, world_size: int = 1) -> LineIndex:
        """The split's line counts, counted once; with a process group each rank counts 1/world of the chunks."""
        if split not in self._line_indexes:
            from lightning_recsys.data.criteo_ranges import LineIndex, count_chunk_lines, file_chunks

            chunks = file_chunks(self.config.split_paths(split))
            strategy = getattr(self.trainer, "strategy", None)
            share = world_size > 1 and strategy is not None and torch.distributed.is_available() and torch.distributed.is_initialized()
            counted = torch.zeros((len(chunks), 2), dtype=torch.int64)
            for i in range(rank, len(chunks), world_size) if share else range(len(chunks)):
                counted[i] = torch.tensor(count_chunk_lines(chunks[i]))
            if share:
                counted = strategy.reduce(counted.to(strategy.root_device), reduce_op="sum").cpu()
            self._line_indexes[split] = LineIndex(chunks, counted[:, 0].tolist(), counted[:, 1].tolist())
        return self._line_indexes[split]
