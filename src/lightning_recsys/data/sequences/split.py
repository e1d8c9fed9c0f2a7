"""The leave-one-out split of SASRec and BERT4Rec, and the ``SequenceBatch`` of a set of its examples.

Per user with ``n`` interactions ``s[0] .. s[n-1]``, oldest first (SASRec's ``util.data_partition``):

- ``n >= 3``: ``s[n-1]`` is the test target, ``s[n-2]`` the validation target, ``s[:n-2]`` trains.
- ``n < 3``: no validation or test example; all ``n`` items train.
- A training part of fewer than 2 items gives no training example (nothing to predict from).

An example is a user's sequence up to and including its target, ``s[:end]``: training ``end`` = the
training part's length, validation ``n - 1``, test ``n``. Its input is ``s[:end - 1]`` and its next
items ``s[1:end]``, both cut to the newest ``max_length`` (the oldest are dropped); the last next item
is the target. ``seen`` is the whole of ``s[:end - 1]``, uncut (validation: the training items; test:
training and validation items), sent with evaluation examples only. A training example thus never
holds a validation or test item, and a validation example never holds the test item. Where the
sequences have timestamps, a batch carries its input items' times (``SequenceBatch.timestamps``).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torchrec import KeyedJaggedTensor

from lightning_recsys.contracts.names import ACTION_FEATURE, ITEM_FEATURE, NEGATIVE_FEATURE, NEXT_ITEM_FEATURE
from lightning_recsys.data.batch import SequenceBatch
from lightning_recsys.data.module import Split
from lightning_recsys.data.sequences.reader import UserSequences

log = logging.getLogger(__name__)

MIN_EVALUATED_LENGTH = 3  # a validation and a test target, and at least one item before them
MIN_TRAINING_LENGTH = 2  # an input item and its next item


class LeaveOneOutSplit:
    """Each split's examples as ``(user, end)`` pairs: the user's sequence ``s[:end]`` ends with the target.

    Attributes:
        users_without_eval: users with fewer than 3 interactions (no validation or test example;
            all their items train).
        users_without_train: users whose training part has fewer than 2 items (no training example).
    """

    def __init__(self, sequences: UserSequences) -> None:
        self.sequences = sequences
        lengths = sequences.lengths
        evaluated = lengths >= MIN_EVALUATED_LENGTH
        train_lengths = np.where(evaluated, lengths - 2, lengths)
        trained = train_lengths >= MIN_TRAINING_LENGTH
        self.users_without_eval = int((~evaluated).sum())
        self.users_without_train = int((~trained).sum())
        eval_users = np.flatnonzero(evaluated)
        train_users = np.flatnonzero(trained)
        self._users: dict[Split, np.ndarray] = {"train": train_users, "val": eval_users, "test": eval_users}
        self._ends: dict[Split, np.ndarray] = {
            "train": train_lengths[train_users], "val": lengths[eval_users] - 1, "test": lengths[eval_users],
        }

    def num_examples(self, split: Split) -> int:
        return len(self._users[split])

    def examples(self, split: Split) -> tuple[np.ndarray, np.ndarray]:
        """``(users, ends)``: user indices and their example's length ``end`` (target at ``end - 1``), in user order."""
        return self._users[split], self._ends[split]

    def log_counts(self, source: str) -> None:
        log.info(
            "%s: %d users, %d items; %d training, %d validation and %d test examples; %d users with fewer than %d "
            "interactions have no validation or test example, %d users have no training example (fewer than %d "
            "training items).",
            source, self.sequences.num_users, self.sequences.num_items, self.num_examples("train"),
            self.num_examples("val"), self.num_examples("test"), self.users_without_eval, MIN_EVALUATED_LENGTH,
            self.users_without_train, MIN_TRAINING_LENGTH,
        )


def _ranges(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """The positions ``starts[b] .. stops[b] - 1`` of every ``b``, concatenated."""
    lengths = stops - starts
    shifts = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return np.arange(int(lengths.sum()), dtype=np.int64) + shifts


def spread_lengths(num_ids: int, batch_size: int) -> torch.Tensor:
    """How many of ``num_ids`` pool ids each of ``batch_size`` examples holds: ``ceil`` for the first ``num_ids % B``, then ``floor``."""
    if batch_size == 0:
        return torch.zeros(0, dtype=torch.long)
    lengths = torch.full((batch_size,), num_ids // batch_size, dtype=torch.long)
    lengths[: num_ids % batch_size] += 1
    return lengths


def sequence_batch(
    sequences: UserSequences, users: np.ndarray, ends: np.ndarray, max_length: int, *, negatives: torch.Tensor | None
) -> SequenceBatch:
    """The examples ``s_u[:end]`` as a ``SequenceBatch``: training batches carry ``negatives`` (the local pool),
    evaluation batches (``negatives=None``) carry the seen ids and no negatives."""
    first = sequences.offsets[users]
    stop = first + ends - 1  # the input stops before the target
    start = np.maximum(first, stop - max_length)
    positions = _ranges(start, stop)
    lengths = torch.from_numpy(stop - start)
    items = torch.from_numpy(sequences.items[positions])
    next_items = torch.from_numpy(sequences.items[positions + 1])
    # The targets ride the sharded lookup too: their embeddings are the positives of the loss.
    keys, values, key_lengths = [ITEM_FEATURE, NEXT_ITEM_FEATURE], [items, next_items], [lengths, lengths]
    if sequences.actions is not None:
        keys.append(ACTION_FEATURE)
        values.append(torch.from_numpy(sequences.actions[positions]))
        key_lengths.append(lengths)
    pool = torch.zeros(0, dtype=torch.long) if negatives is None else negatives
    keys.append(NEGATIVE_FEATURE)
    values.append(pool)
    key_lengths.append(spread_lengths(len(pool), len(users)))
    if negatives is None:
        seen_lengths = torch.from_numpy(stop - first)
        seen_ids = torch.from_numpy(sequences.items[_ranges(first, stop)])
    else:
        seen_lengths, seen_ids = torch.zeros(len(users), dtype=torch.long), torch.zeros(0, dtype=torch.long)
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(key_lengths))
    # Each input item's time, cut like the items (outside the KJT: no table reads it).
    timestamps = None if sequences.timestamps is None else torch.from_numpy(sequences.timestamps[positions].astype(np.int64, copy=False))
    return SequenceBatch(sparse=sparse, next_item_ids=next_items, seen_ids=seen_ids, seen_lengths=seen_lengths, timestamps=timestamps)
