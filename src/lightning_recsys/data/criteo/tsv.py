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
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch.utils.data import get_worker_info

from lightning_recsys.data.batch import RecBatch
from lightning_recsys.data.criteo.format import (  # the format's names stay importable from here
    _LINE,
    CRITEO_FEATURE_NAMES,
    CRITEO_READERS,
    NUM_CATEGORICAL_FEATURES,
    NUM_INTEGER_FEATURES,
    STAGE_SPLITS,
    CriteoConfig,
    CriteoFeatures,
    CriteoReader,
    _diagnose,
    check_split_files,
)
from lightning_recsys.data.criteo.parse import criteo_batch, dense_transform, parse_criteo_rows
from lightning_recsys.data.module import RankSlicedDataModule, Split
from lightning_recsys.data.readers import BadLineTally, GlobalBatchDataset, OnBadLine, check_num_workers, iter_lines

if TYPE_CHECKING:
    from lightning_recsys.data.criteo.ranges import LineIndex

__all__ = [
    "CRITEO_FEATURE_NAMES",
    "CRITEO_READERS",
    "NUM_CATEGORICAL_FEATURES",
    "NUM_INTEGER_FEATURES",
    "STAGE_SPLITS",
    "CriteoConfig",
    "CriteoDataModule",
    "CriteoDataset",
    "CriteoFeatures",
    "CriteoReader",
    "check_split_files",
    "criteo_batch",
    "dense_transform",
    "parse_criteo_rows",
]


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
        from lightning_recsys.data.criteo.arrow import CriteoArrowDataset

        index = self.line_index(split, rank, world_size) if world_size > 1 else None
        return CriteoArrowDataset(self.config, split, rank, world_size, line_index=index)

    def line_index(self, split: Split, rank: int = 0, world_size: int = 1) -> LineIndex:
        """The split's line counts, counted once; with a process group each rank counts 1/world of the chunks."""
        if split not in self._line_indexes:
            from lightning_recsys.data.criteo.ranges import LineIndex, count_chunk_lines, file_chunks

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
