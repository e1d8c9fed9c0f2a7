"""The pretraining oracle: a tiny ``SequencePretrainer`` on hand-made batches, trained unsharded with SGD on the ranks' slices.

A ``SequenceBatch`` here follows the pretraining contract (``lightning_recsys.data.batch``): ``item_id``
oldest first, ``next_item_id`` = the item after each input (also ``next_item_ids``), ``action`` with
the same lengths, and ``negative_item_id``, the batch's shared pool spread over the examples. Global
batch ``i`` is the same for any number of ranks; rank ``r`` of ``W`` trains on examples
``[r * B / W, (r + 1) * B / W)`` with the negatives those examples carry, so the loss of rank ``r`` is
that slice's loss, and the sharded step equals one unsharded SGD step on the mean of the slices' losses
(DDP averages the dense gradients; TorchRec's all-to-all divides the table gradients by the world size):
``train_unsharded(world_size)`` takes the world size for that reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import IterableDataset
from torchrec import KeyedJaggedTensor

from lightning_recsys.data.batch import SequenceBatch
from lightning_recsys.data.module import RankSlicedDataModule
from lightning_recsys.models import SequencePretrainer
from lightning_recsys.testing.oracle.core import Oracle

ITEMS, ACTIONS, DIM, MAX_LENGTH = 64, 3, 8, 6
STEPS, GLOBAL_BATCH, POOL_PER_EXAMPLE = 3, 8, 2
EMBEDDING_LR, DENSE_LR = 0.5, 0.1
ITEM_KEY = "item_embeddings.embeddings.item.weight"
ACTION_KEY = "item_embeddings.embeddings.action.weight"
TABLES = ("item", "action")


def make_batch(
    sequences: list[list[int]],
    next_items: list[list[int]] | None = None,
    pool: list[list[int]] | None = None,
    actions: list[list[int]] | None = None,
    seen: list[list[int]] | None = None,
) -> SequenceBatch:
    """A ``SequenceBatch`` from per-example lists. ``next_items`` default: each sequence shifted by one, then
    ``sequence[-1] + 1``; ``pool``: each example's share of the negatives (default none)."""
    size = len(sequences)
    if next_items is None:
        next_items = [s[1:] + [s[-1] + 1] if s else [] for s in sequences]
    pool = pool if pool is not None else [[] for _ in range(size)]
    seen = seen if seen is not None else [[] for _ in range(size)]
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
    flat = lambda lists: torch.tensor([v for values in lists for v in values], dtype=torch.long)  # noqa: E731
    keys, values, all_lengths = ["item_id"], [flat(sequences)], [lengths]
    if actions is not None:
        keys, values, all_lengths = keys + ["action"], values + [flat(actions)], all_lengths + [lengths]
    keys += ["next_item_id", "negative_item_id"]
    values += [flat(next_items), flat(pool)]
    all_lengths += [lengths, torch.tensor([len(p) for p in pool], dtype=torch.long)]
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(all_lengths))
    return SequenceBatch(
        sparse=sparse, next_item_ids=flat(next_items), seen_ids=flat(seen), seen_lengths=torch.tensor([len(s) for s in seen], dtype=torch.long)
    )


@dataclass(frozen=True)
class PretrainLogConfig:
    global_batch_size: int = GLOBAL_BATCH
    train_batches: int = STEPS
    max_sequence: int = MAX_LENGTH + 3  # longer than the model reads: the cut is exercised sharded too
    seed: int = 11


CONFIG = PretrainLogConfig()


def global_lists(config: PretrainLogConfig, split: str, index: int) -> dict[str, list[list[int]]]:
    """Global batch ``index`` as per-example lists: some empty sequences, some longer than MAX_LENGTH, hits in the pool."""
    generator = torch.Generator().manual_seed(config.seed * 1000 + {"train": 0, "val": 1}[split] * 100 + index)
    sequences, next_items, actions, pool, seen = [], [], [], [], []
    low = 0 if split == "train" else 1  # every evaluated user has an input item
    for _ in range(config.global_batch_size):
        length = int(torch.randint(low, config.max_sequence + 1, (1,), generator=generator))
        # Ids from the lower half of the table only (the upper half stays untouched unless sampled as negatives).
        items = torch.randint(0, ITEMS // 2, (length + 1,), generator=generator).tolist()
        sequences.append(items[:-1])
        next_items.append(items[1:])
        actions.append(torch.randint(0, ACTIONS, (length,), generator=generator).tolist())
        if split == "train":
            negatives = torch.randint(0, ITEMS, (POOL_PER_EXAMPLE,), generator=generator).tolist()
            negatives[0] = items[-1] if length else negatives[0]  # an accidental hit: the example's own last target
            pool.append(negatives)
        else:
            pool.append([])
        seen.append(items[:-1] if split != "train" else [])
    return {"sequences": sequences, "next_items": next_items, "actions": actions, "pool": pool, "seen": seen}


def slice_lists(lists: dict[str, list[list[int]]], start: int, stop: int) -> SequenceBatch:
    part = {name: values[start:stop] for name, values in lists.items()}
    return make_batch(part["sequences"], part["next_items"], part["pool"], part["actions"], part["seen"])


def rank_batch(config: PretrainLogConfig, split: str, index: int, rank: int, world_size: int) -> SequenceBatch:
    """Rank ``rank``'s slice of global batch ``index``, with the negatives its examples carry."""
    local = config.global_batch_size // world_size
    return slice_lists(global_lists(config, split, index), rank * local, (rank + 1) * local)


def global_batch(config: PretrainLogConfig, split: str, index: int) -> SequenceBatch:
    return rank_batch(config, split, index, 0, 1)


class _Slices(IterableDataset):
    def __init__(self, config: PretrainLogConfig, split: str, num_batches: int, rank: int, world_size: int) -> None:
        self.config, self.split, self.num_batches, self.rank, self.world_size = config, split, num_batches, rank, world_size

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self):  # type: ignore[no-untyped-def]
        for index in range(self.num_batches):
            yield rank_batch(self.config, self.split, index, self.rank, self.world_size)


class PretrainDataModule(RankSlicedDataModule):
    """This rank's slice of every global batch of ``config`` (train), and one validation batch."""

    def __init__(self, config: PretrainLogConfig | None = None) -> None:
        super().__init__()
        self.config = config or CONFIG

    def _dataset(self, split: str, rank: int, world_size: int) -> _Slices:  # type: ignore[override]
        return _Slices(self.config, "train" if split == "train" else "val", self.config.train_batches if split == "train" else 1, rank, world_size)


def make_model(
    embedding_device: str | None = None, seed: int | None = 1234, *, cls: type[SequencePretrainer] = SequencePretrainer, **overrides: object
) -> SequencePretrainer:
    if seed is not None:
        torch.manual_seed(seed)
    arguments = dict(
        num_items=ITEMS, num_action_types=ACTIONS, embedding_dim=DIM, max_length=MAX_LENGTH, num_layers=2, num_heads=2,
        dropout=0.0, temperature=0.5, in_batch_negatives=True, init_std=0.1, dense_optimizer="sgd", dense_lr=DENSE_LR,
        embedding_device=embedding_device,
    )  # fmt: skip
    return cls(**{**arguments, **overrides})  # type: ignore[arg-type]


def is_table(key: str) -> bool:
    return key.startswith("item_embeddings.")


def _loss(model: SequencePretrainer, batch: SequenceBatch) -> torch.Tensor:
    return model.training_losses(batch)["loss"]


ORACLE = Oracle(
    make_model=make_model, config=CONFIG, datamodule=PretrainDataModule, rank_batch=rank_batch, loss=_loss, is_table=is_table,
    compared=lambda key: True, tables=TABLES, dim=DIM, table_key=ITEM_KEY, steps=STEPS, embedding_lr=EMBEDDING_LR, dense_lr=DENSE_LR,
)  # fmt: skip
train_unsharded = ORACLE.train_unsharded
fit_sharded = ORACLE.fit_sharded
local_predictions = ORACLE.local_predictions
sgd_strategy = ORACLE.sgd_strategy
shards_of = ORACLE.shards_of
table_shards = ORACLE.table_shards
assert_matches = ORACLE.assert_matches


def touched_rows(config: PretrainLogConfig | None = None, steps: int = STEPS, kept_only: bool = False) -> set[int]:
    """Every item row that a training step looks up: inputs, targets and negatives. ``kept_only``: only the
    inputs and targets of the newest MAX_LENGTH positions (the rest are looked up but reach no loss)."""
    config = config or CONFIG
    cut = (lambda values: values[-MAX_LENGTH:]) if kept_only else (lambda values: values)  # noqa: E731
    rows: set[int] = set()
    for step in range(steps):
        lists = global_lists(config, "train", step)
        for name in ("sequences", "next_items"):
            rows |= {v for values in lists[name] for v in cut(values)}
        rows |= {v for values in lists["pool"] for v in values}
    return rows


def train_two_replicas(replica_size: int, steps: int = STEPS, *, overlap: bool, config: PretrainLogConfig | None = None) -> dict[str, torch.Tensor]:
    """2D with SGD and a replica sync after every step, written out unsharded: two replicas of the tables, one dense part.

    Replica ``a`` (the first sharding group, ranks ``0 .. replica_size - 1``) trains on the first half of each global
    batch and replica ``b`` on the second. The dense gradient is the mean over all ``2 * replica_size`` slices (DDP over
    every rank); a replica's table gradient the mean over its own slices. After each step every row is averaged over
    the replicas (touched-row sync averages the rows either replica looked up; the others are equal already). With
    ``overlap``, the average of the values sent at the end of step ``t`` lands at the end of step ``t + 1`` and keeps
    the updates made meanwhile (``row = average(sent) + (row - sent)``); the end of training applies the last one.
    Returns replica ``a``'s state dict (the replicas are equal at the end)."""
    config = config or CONFIG
    world = 2 * replica_size
    models = [make_model(), make_model()]
    optimizers = []
    for model in models:
        params = dict(model.named_parameters())
        optimizers.append(torch.optim.SGD([
            {"params": [p for n, p in params.items() if not is_table(n)], "lr": DENSE_LR},
            {"params": [p for n, p in params.items() if is_table(n)], "lr": EMBEDDING_LR},
        ]))
    table_params = [[p for n, p in m.named_parameters() if is_table(n)] for m in models]
    dense_params = [[p for n, p in m.named_parameters() if not is_table(n)] for m in models]

    def average_tables() -> list[torch.Tensor]:
        return [(a + b) / 2 for a, b in zip(*([p.detach().clone() for p in params] for params in table_params), strict=True)]

    in_flight: tuple[list[torch.Tensor], list[list[torch.Tensor]]] | None = None
    for step in range(steps):
        for model, optimizer, replica in zip(models, optimizers, range(2), strict=True):
            optimizer.zero_grad()
            slices = range(replica * replica_size, (replica + 1) * replica_size)
            (sum(model.training_losses(rank_batch(config, "train", step, r, world))["loss"] for r in slices) / replica_size).backward()
        with torch.no_grad():
            for a, b in zip(*dense_params, strict=True):  # DDP: the mean over every rank's slice
                a.grad = b.grad = (a.grad + b.grad) / 2
            for optimizer in optimizers:
                optimizer.step()
            if not overlap:
                averages = average_tables()
                for params in table_params:
                    for p, average in zip(params, averages, strict=True):
                        p.copy_(average)
                continue
            if in_flight is not None:
                averages, sent = in_flight
                for params, sent_values in zip(table_params, sent, strict=True):
                    for p, average, s in zip(params, averages, sent_values, strict=True):
                        p.copy_(average + (p - s))
            in_flight = (average_tables(), [[p.detach().clone() for p in params] for params in table_params])
    if in_flight is not None:  # the end of training: the sync in flight lands, nothing has moved since it was sent
        with torch.no_grad():
            for params in table_params:
                for p, average in zip(params, in_flight[0], strict=True):
                    p.copy_(average)
    return {k: v.detach().clone() for k, v in models[0].state_dict().items()}
