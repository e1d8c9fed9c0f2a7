"""Does a prepared directory give the same evaluation examples as the text file it came from?

Reads a BERT4Rec/SASRec ``user item`` file with ``SequenceFileDataModule`` and the directory that
``lightning-recsys prepare --input-format user-item-lines`` made of it with ``SequenceParquetDataModule``,
maps both back to the raw item ids (text: row + 1; prepared: ``items.parquet``), and compares every
validation and test example: its input items (cut to ``--max-length``), its target and its seen items.
The prepared side is read as ``--world-size`` ranks, each rank's batches concatenated. Prints one line
per split and exits 1 if any differ.

    lightning-recsys prepare --input beauty.txt --input-format user-item-lines --output beauty_prepared
    python benchmarks/prepared_equivalence.py --text beauty.txt --prepared beauty_prepared --world-size 2
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Iterable

import numpy as np
import pyarrow.parquet as pq

from lightning_recsys.contracts.names import ITEM_FEATURE
from lightning_recsys.data.batch import SequenceBatch
from lightning_recsys.data.parquet import SequenceParquetDataModule
from lightning_recsys.data.sequences import SequenceFileDataModule

Example = tuple[tuple[int, ...], int, tuple[int, ...]]  # input items, target, seen items (raw ids)


def examples(batches: Iterable[SequenceBatch], raw_ids: np.ndarray) -> Counter[Example]:
    """Every example of ``batches`` in raw ids, counted (the two paths order users differently)."""
    found: Counter[Example] = Counter()
    for batch in batches:
        lengths = batch.sparse[ITEM_FEATURE].lengths().tolist()
        inputs = raw_ids[batch.sparse[ITEM_FEATURE].values().numpy()]
        targets = raw_ids[batch.next_item_ids.numpy()]
        seen = raw_ids[batch.seen_ids.numpy()]
        seen_lengths = batch.seen_lengths.tolist()
        start = seen_start = 0
        for length, seen_length in zip(lengths, seen_lengths):
            found[(
                tuple(inputs[start : start + length].tolist()), int(targets[start + length - 1]),
                tuple(seen[seen_start : seen_start + seen_length].tolist()),
            )] += 1
            start, seen_start = start + length, seen_start + seen_length
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", required=True, help="the 'user item' file")
    parser.add_argument("--prepared", required=True, help="the directory `lightning-recsys prepare` made of it")
    parser.add_argument("--max-length", type=int, default=50)
    parser.add_argument("--global-batch-size", type=int, default=128)
    parser.add_argument("--world-size", type=int, default=2, help="ranks the prepared side is read as")
    args = parser.parse_args(argv)

    text = SequenceFileDataModule(args.text, max_length=args.max_length, global_batch_size=args.global_batch_size)
    prepared = SequenceParquetDataModule(args.prepared, max_length=args.max_length, global_batch_size=args.global_batch_size)
    text_raw = np.arange(1, text.num_items + 1, dtype=np.int64)  # row r is item id r + 1
    vocabulary = pq.read_table(f"{args.prepared}/items.parquet", columns=["item_id", "row"])
    prepared_raw = np.full(prepared.num_items, -1, dtype=np.int64)  # the out-of-vocabulary row, if any, maps to -1
    prepared_raw[vocabulary["row"].to_numpy()] = vocabulary["item_id"].to_numpy().astype(np.int64)

    different = 0
    for split in ("val", "test"):
        expected = examples(text._dataset(split, 0, 1), text_raw)
        got: Counter[Example] = Counter()
        for rank in range(args.world_size):
            got += examples(prepared.stream(split, rank, args.world_size), prepared_raw)
        missing, extra = expected - got, got - expected
        same = not missing and not extra
        different += not same
        print(
            f"{split}: text {sum(expected.values()):,} examples, prepared {sum(got.values()):,} over {args.world_size} ranks; "
            f"{'identical' if same else f'{sum(missing.values()):,} missing, {sum(extra.values()):,} extra'}"
        )
    return 1 if different else 0


if __name__ == "__main__":
    sys.exit(main())
