"""trainer.predict over 2 ranks (gloo): every example predicted exactly once, as the unsharded model predicts it."""

from __future__ import annotations

import dataclasses

import torch
from lightning.pytorch import LightningDataModule, Trainer
from lightning_recsys.testing.oracle.click import CONFIG, make_model, sgd_strategy
from lightning_recsys.testing.processes import run_ranks
from torch.utils.data import DataLoader, Dataset
from torchrec import KeyedJaggedTensor

from lightning_recsys.data import SyntheticClickLog, SyntheticClickLogDataModule, slice_batch
from lightning_recsys.data.batch import RecBatch
from lightning_recsys.models import DLRMRanker

PREDICT_CONFIG = dataclasses.replace(CONFIG, test_batches=3)
# 19 examples, batches of 4: Lightning's unrepeated predict sampler gives the ranks 10 and 9, so
# the last batches are 2 and 1 examples.
MAP_EXAMPLES, MAP_BATCH = 19, 4


class _TaggedRanker(DLRMRanker):
    """Predicts (example tag, probability): the first dense feature tags an example."""

    def predict_step(self, batch: RecBatch, batch_idx: int) -> torch.Tensor:
        return torch.stack([batch.dense[:, 0], super().predict_step(batch, batch_idx)], 1)


def _map_batch() -> RecBatch:
    return SyntheticClickLog(dataclasses.replace(CONFIG, global_batch_size=MAP_EXAMPLES)).global_batch("test", 0)


def _collate(examples: list[RecBatch]) -> RecBatch:
    keys = examples[0].sparse.keys()
    jagged = [e.sparse[k] for k in keys for e in examples]
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.cat([j.values() for j in jagged]), lengths=torch.cat([j.lengths() for j in jagged])
    )
    return RecBatch(dense=torch.cat([e.dense for e in examples]), sparse=sparse, labels=torch.cat([e.labels for e in examples]))


class _Examples(Dataset):
    """A plain map-style dataset of single examples, no sharding of its own."""

    def __init__(self) -> None:
        self.batch = _map_batch()

    def __len__(self) -> int:
        return MAP_EXAMPLES

    def __getitem__(self, index: int) -> RecBatch:
        return slice_batch(self.batch, index, index + 1)


class _MapStyle(LightningDataModule):
    def predict_dataloader(self) -> DataLoader:
        return DataLoader(_Examples(), batch_size=MAP_BATCH, collate_fn=_collate)


def _predict(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    results = {}
    for name, datamodule in (("synthetic", SyntheticClickLogDataModule.from_config(PREDICT_CONFIG)), ("map_style", _MapStyle())):
        trainer = Trainer(
            accelerator="cpu", devices=world_size, strategy=sgd_strategy(sharding_types=["row_wise"]), logger=False,
            enable_progress_bar=False, enable_model_summary=False,
        )
        results[name] = torch.cat(trainer.predict(make_model(cls=_TaggedRanker), datamodule=datamodule))
    return results


def _expected(batches: list[RecBatch]) -> dict[float, float]:
    model = make_model()  # the same initial weights, unsharded
    model.eval()
    with torch.no_grad():
        return {float(t): float(p) for b in batches for t, p in zip(b.dense[:, 0], torch.sigmoid(model(b)))}


def test_predict_covers_every_example_once_with_per_rank_and_map_style_data() -> None:
    results = run_ranks(_predict, 2, timeout=400)
    log = SyntheticClickLog(PREDICT_CONFIG)
    expected = {
        "synthetic": _expected([log.global_batch("test", i) for i in range(PREDICT_CONFIG.test_batches)]),
        "map_style": _expected([_map_batch()]),
    }
    for name, by_tag in expected.items():
        predicted = torch.cat([r[name] for r in results])
        tags = predicted[:, 0].tolist()
        assert len(tags) == len(by_tag) and set(tags) == set(by_tag), (
            f"{name}: {len(tags)} predictions ({len(set(tags))} distinct) for {len(by_tag)} examples"
        )
        actual = {t: p for t, p in predicted.tolist()}
        torch.testing.assert_close(torch.tensor([actual[t] for t in by_tag]), torch.tensor(list(by_tag.values())))
