"""The Criteo TSV format and its checks: the fields of a line, the line check, ``CriteoConfig``.

The bottom of the Criteo modules: parsing (``criteo_parse``) builds on it, and the datasets
(``tsv``, ``arrow``, ``binary``) on both. Each line is ``label \\t I1 .. I13 \\t C1 .. C26``;
``lightning_recsys.data.criteo.tsv`` describes the features made of it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from lightning_recsys.data.module import Split
from lightning_recsys.data.readers import (
    OnBadLine,
    check_global_batch_size,
    check_on_bad_line,
    check_split_sources,
    normalized_path,
)

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
            (``lightning_recsys.data.criteo.arrow``); ``"python"`` is the line-by-line
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
