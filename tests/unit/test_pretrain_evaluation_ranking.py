"""SequencePretrainer builds its item ranking once per validation or test loop (the table does not change during
one), drops it at the loop's end, and ranks exactly as when it built one per batch."""

from __future__ import annotations

import torch
from lightning.pytorch import Trainer
from lightning_recsys.testing.oracle.pretrain import make_batch
from torch.utils.data import DataLoader

from lightning_recsys.models import SequencePretrainer
from lightning_recsys.parallel.ranking import ItemRanking

ITEMS = 40
SEQUENCES = [[[1, 2, 3], [5], [9, 2, 4]], [[11, 13], [7, 8, 9, 10]], [[20, 21], [3], [30, 31, 32]]]  # three batches


def _model() -> SequencePretrainer:
    torch.manual_seed(0)
    return SequencePretrainer(num_items=ITEMS, embedding_dim=8, max_length=5, num_layers=1, dropout=0.0, init_std=0.3, eval_k=[1, 10])


def _batches():  # type: ignore[no-untyped-def]
    targets = iter(range(14, 40))
    for users in SEQUENCES:
        yield make_batch(users, [s[1:] + [next(targets)] for s in users], seen=users)


class _Batches(torch.utils.data.IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return _batches()


class _CountingPretrainer(SequencePretrainer):
    built = 0

    def item_ranking(self) -> ItemRanking:
        self.built += 1
        return super().item_ranking()


def test_validation_and_test_build_the_ranking_once_per_loop() -> None:
    torch.manual_seed(0)
    model = _CountingPretrainer(num_items=ITEMS, embedding_dim=8, max_length=5, num_layers=1, dropout=0.0, init_std=0.3, eval_k=[1, 10])
    trainer = Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    (validated,) = trainer.validate(model, DataLoader(_Batches(), batch_size=None), verbose=False)
    assert model.built == 1  # three batches, one ranking
    assert model._evaluation_ranking is None  # dropped at the loop's end
    (tested,) = trainer.test(model, DataLoader(_Batches(), batch_size=None), verbose=False)
    assert model.built == 2 and model._evaluation_ranking is None

    reference = _model().eval()  # the same weights, a ranking per batch (steps called outside a loop)
    for batch in _batches():
        reference.validation_step(batch, 0)
    expected = reference.ranking_metrics["val"].compute()
    assert expected["hr@10"] > 0  # some target in the top 10: the comparison means something
    for name, value in expected.items():
        torch.testing.assert_close(torch.tensor(validated[f"val/{name}"]), value.float(), msg=name)
        torch.testing.assert_close(torch.tensor(tested[f"test/{name}"]), value.float(), msg=name)


def test_a_step_outside_a_loop_ranks_the_table_as_it_is_now() -> None:
    model = _model().eval()
    batch = next(_batches())
    model.validation_step(batch, 0)
    before = model.ranking_metrics["val"].compute()["mrr"]
    model.ranking_metrics["val"].reset()
    with torch.no_grad():
        model.item_embeddings.embeddings["item"].weight.mul_(-1)  # every score flips: the ranks change
    model.validation_step(batch, 0)
    assert not torch.equal(model.ranking_metrics["val"].compute()["mrr"], before)
