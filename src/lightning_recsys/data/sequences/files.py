"""``SequenceFileDataModule``: a BERT4Rec/SASRec sequence file, split leave-one-out, for next-item pretraining."""

from __future__ import annotations

from pathlib import Path

from lightning_recsys.data.sequences.module import NumNegatives, SequencePretrainDataModule, check_int
from lightning_recsys.data.sequences.reader import UserSequences, read_sequence_file


class SequenceFileDataModule(SequencePretrainDataModule):
    """A ``user item`` sequence file (e.g. Amazon Beauty as preprocessed by BERT4Rec) as ``SequenceBatch``es.

    The file format and its errors: ``lightning_recsys.data.sequences.reader``; the split:
    ``lightning_recsys.data.sequences.split``; the batches and negatives:
    ``lightning_recsys.data.sequences.module``. The file is read on the first dataloader call (or
    the first read of ``num_items`` when it is not given, or of the counts).

    Args:
        path: the sequence file (plain text or gzip).
        max_length: the newest this many items of a sequence form an example's input (the oldest
            are cut); the seen ids of an evaluation example are never cut.
        num_negatives: sampled negatives per local batch, uniform over the item table's rows with
            replacement; ``"all"``: every row (the full softmax).
        global_batch_size: examples per step over all ranks; a multiple of the world size.
        shuffle: a new order of the training users every epoch (from ``seed`` and the epoch).
        seed: the training order and the negatives follow it.
        num_items: the item table's rows (item id ``i`` is row ``i - 1``). ``None``: the largest
            item id in the file. Give it in a config whose model reads it by interpolation
            (``${data.init_args.num_items}``); a larger id in the file is an error.
        num_action_types: 0 (the default): lines are ``user item``. Otherwise lines are ``user item
            action`` with an action type in ``0 .. num_action_types - 1``, emitted as ``action``.
    """

    def __init__(
        self,
        path: str,
        max_length: int = 50,
        num_negatives: NumNegatives = 3000,
        global_batch_size: int = 128,
        shuffle: bool = True,
        seed: int = 0,
        num_items: int | None = None,
        num_action_types: int = 0,
    ) -> None:
        super().__init__(
            max_length=max_length, num_negatives=num_negatives, global_batch_size=global_batch_size, shuffle=shuffle, seed=seed
        )
        if not str(path):
            raise ValueError(f"path={path!r} must name a sequence file (one 'user item' pair per line).")
        if num_items is not None:
            check_int("num_items", num_items, 1)
        check_int("num_action_types", num_action_types, 0)
        self.path, self._num_items, self._num_action_types = str(path), num_items, num_action_types

    @property
    def num_items(self) -> int:
        """Rows of the item table: ``num_items`` if given, else the largest item id in the file."""
        return self._num_items if self._num_items is not None else self.sequences.num_items

    @property
    def num_action_types(self) -> int:
        """Action types of the ``action`` feature; 0 when the batches have none."""
        return self._num_action_types

    def _source_name(self) -> str:
        return self.path

    def _load(self) -> UserSequences:
        if not Path(self.path).is_file():
            raise FileNotFoundError(
                f"path={self.path!r} does not exist or is not a file: SequenceFileDataModule reads one 'user item' pair per "
                "line, each user's lines together and oldest first (BERT4Rec's data/beauty.txt, for example)."
            )
        return read_sequence_file(self.path, num_items=self._num_items, num_action_types=self._num_action_types)
