"""Synthetic activity sequences with a planted next-item structure, for the demo config and tests (no file).

How they are drawn (all from ``seed``):

- The ``num_items`` rows fall into ``num_clusters`` clusters of ``C = num_items / num_clusters``
  rows, at scattered rows (a random permutation). Each cluster's rows form a cycle in a random order:
  every item has one **successor**, the next item of its cluster's cycle.
- A user picks a cluster and a first item in it, uniformly, and a sequence length uniform on
  ``[min_sequence_length, max_sequence_length]``. Each next item is the current item's successor
  with probability ``1 - jump_probability``, else a uniform item of the same cluster (a jump).
- With ``num_action_types > 0``, each item has an action type drawn uniformly from
  ``0 .. num_action_types - 1``, independent of everything else (they exercise the action path and
  carry no signal).

What a model can reach: the next item depends only on the current one, so the best ranking puts
the successor first and then the rest of the cluster. Its hit rate at ``K <= C`` is
``(1 - p) + p * K / C`` (``expected_hit_rate``; filtering seen items only raises it), e.g. 0.83 at
K = 10 with the defaults (``p = 0.2``, ``C = 64``). Every item is about equally popular, so a
most-popular ranking hits about ``K / num_items`` (0.04).
"""

from __future__ import annotations

import numpy as np

from lightning_recsys.data.sequences.module import NumNegatives, SequencePretrainDataModule, check_int
from lightning_recsys.data.sequences.reader import UserSequences


class PlantedChains:
    """The planted structure: ``cluster_of_row`` and ``successor`` (a row's next row in its cluster's cycle)."""

    def __init__(self, num_items: int, num_clusters: int, rng: np.random.Generator) -> None:
        size = num_items // num_clusters
        self.cluster_size = size
        # Cycle position j of cluster c is row rows[c, j]; its successor is rows[c, (j + 1) % size].
        self.rows = rng.permutation(num_items).reshape(num_clusters, size)
        self.successor = np.empty(num_items, dtype=np.int64)
        self.successor[self.rows] = np.roll(self.rows, -1, axis=1)
        self.cluster_of_row = np.empty(num_items, dtype=np.int64)
        self.cluster_of_row[self.rows] = np.arange(num_clusters)[:, None]


def planted_sequences(
    *, num_users: int, num_items: int, num_clusters: int, min_sequence_length: int, max_sequence_length: int,
    jump_probability: float, num_action_types: int, seed: int,
) -> tuple[UserSequences, PlantedChains]:
    """Every user's sequence (see the module docstring) and the chains they walk."""
    rng = np.random.default_rng(seed)
    chains = PlantedChains(num_items, num_clusters, rng)
    size = chains.cluster_size
    clusters = rng.integers(0, num_clusters, num_users)
    lengths = rng.integers(min_sequence_length, max_sequence_length + 1, num_users)
    walk = np.empty((num_users, max_sequence_length), dtype=np.int64)
    walk[:, 0] = chains.rows[clusters, rng.integers(0, size, num_users)]
    for step in range(1, max_sequence_length):
        jump = rng.random(num_users) < jump_probability
        jumped_to = chains.rows[clusters, rng.integers(0, size, num_users)]
        walk[:, step] = np.where(jump, jumped_to, chains.successor[walk[:, step - 1]])
    valid = np.arange(max_sequence_length) < lengths[:, None]
    actions = rng.integers(0, num_action_types, walk.shape)[valid] if num_action_types else None
    sequences = UserSequences(
        items=walk[valid], offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        user_ids=np.arange(1, num_users + 1), num_items=num_items, num_action_types=num_action_types, actions=actions,
    )
    return sequences, chains


class SyntheticPretrainDataModule(SequencePretrainDataModule):
    """Synthetic sequences with planted successor chains (see the module docstring), split leave-one-out.

    Args:
        num_users: users (one sequence each).
        num_items: rows of the item table; a multiple of ``num_clusters``.
        num_clusters: item clusters; a user stays in one.
        min_sequence_length, max_sequence_length: sequence lengths are uniform on this range
            (inclusive); 3 or more gives every user a validation and a test example, 4 or more a
            training example too.
        jump_probability: the chance that a next item is a uniform item of the cluster rather than
            the successor (0: fully predictable).
        num_action_types: 0 for no ``action`` feature; otherwise uniform action types (no signal).
        max_length, num_negatives, global_batch_size, shuffle: as ``SequenceFileDataModule``'s.
        seed: the sequences, the training order and the negatives follow it.

    ``expected_hit_rate(k)`` is the hit rate at ``k`` of the best possible ranking.
    """

    def __init__(
        self,
        num_users: int = 1024,
        num_items: int = 256,
        num_clusters: int = 4,
        min_sequence_length: int = 8,
        max_sequence_length: int = 24,
        jump_probability: float = 0.2,
        num_action_types: int = 0,
        max_length: int = 50,
        num_negatives: NumNegatives = 64,
        global_batch_size: int = 64,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(
            max_length=max_length, num_negatives=num_negatives, global_batch_size=global_batch_size, shuffle=shuffle, seed=seed
        )
        check_int("num_users", num_users, 1)
        check_int("num_clusters", num_clusters, 1)
        check_int("num_items", num_items, num_clusters)
        if num_items % num_clusters:
            raise ValueError(
                f"num_items={num_items} must be a multiple of num_clusters={num_clusters} (equal clusters); "
                f"use e.g. {num_items // num_clusters * num_clusters}."
            )
        check_int("min_sequence_length", min_sequence_length, 1)
        check_int("max_sequence_length", max_sequence_length, min_sequence_length)
        if not 0.0 <= jump_probability <= 1.0:
            raise ValueError(f"jump_probability={jump_probability} must be a probability in [0, 1].")
        check_int("num_action_types", num_action_types, 0)
        self.num_users, self.num_items, self.num_clusters = num_users, num_items, num_clusters
        self.min_sequence_length, self.max_sequence_length = min_sequence_length, max_sequence_length
        self.jump_probability, self.num_action_types = float(jump_probability), num_action_types
        self._chains: PlantedChains | None = None

    @property
    def chains(self) -> PlantedChains:
        """The planted successor chains (drawn with the sequences, on first use)."""
        self.split  # noqa: B018 (draws the sequences and the chains once)
        assert self._chains is not None
        return self._chains

    def expected_hit_rate(self, k: int) -> float:
        """HR@k of the best ranking (successor first, then its cluster), before seen items are filtered."""
        size = self.num_items // self.num_clusters
        return (1.0 - self.jump_probability) + self.jump_probability * min(k, size) / size

    def _load(self) -> UserSequences:
        sequences, self._chains = planted_sequences(
            num_users=self.num_users, num_items=self.num_items, num_clusters=self.num_clusters,
            min_sequence_length=self.min_sequence_length, max_sequence_length=self.max_sequence_length,
            jump_probability=self.jump_probability, num_action_types=self.num_action_types, seed=self.seed,
        )
        return sequences
