"""RankingMetrics (HR@K, NDCG@K, MRR from target ranks) against torchmetrics' retrieval metrics on full score lists."""

import math

import pytest
import torch
from torchmetrics.retrieval import RetrievalHitRate, RetrievalMRR, RetrievalNormalizedDCG

from lightning_recsys.models import RankingMetrics


def _random_case(seed: int, users: int, items: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct scores per user (no ties), all > 0 (torchmetrics 1.9's reciprocal rank gives 0 for a target scored
    exactly 0), and one target each."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.stack([(torch.randperm(items, generator=generator).double() + 1) / items for _ in range(users)])
    targets = torch.randint(0, items, (users,), generator=generator)
    return scores, targets


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("ks", [(1, 3), (10, 100), (5,)])
def test_matches_torchmetrics_retrieval_metrics_on_full_score_lists(seed, ks):
    users, items = 13, 40
    scores, targets = _random_case(seed, users, items)
    ranks = (scores > scores.gather(1, targets[:, None])).sum(1)  # items above the target
    metrics = RankingMetrics(ks)
    metrics.update(ranks[:6])
    metrics.update(ranks[6:])  # sums add across updates
    values = metrics.compute()

    relevant = torch.zeros(users, items, dtype=torch.bool)
    relevant[torch.arange(users), targets] = True
    indexes = torch.arange(users)[:, None].expand(users, items)
    flat = (scores.flatten(), relevant.flatten(), indexes.flatten())
    for k in ks:
        torch.testing.assert_close(values[f"hr@{k}"].float(), RetrievalHitRate(top_k=k)(*flat).float())
        torch.testing.assert_close(values[f"ndcg@{k}"].float(), RetrievalNormalizedDCG(top_k=k)(*flat).float())
    torch.testing.assert_close(values["mrr"].float(), RetrievalMRR()(*flat).float())
    assert 0 < float(values["mrr"]) < 1


def test_values_by_hand():
    metrics = RankingMetrics([2])
    metrics.update(torch.tensor([0, 1, 5]))
    values = metrics.compute()
    assert float(values["hr@2"]) == pytest.approx(2 / 3)
    assert float(values["ndcg@2"]) == pytest.approx((1 + 1 / math.log2(3)) / 3)
    assert float(values["mrr"]) == pytest.approx((1 + 1 / 2 + 1 / 6) / 3)


def test_reset_and_keys():
    metrics = RankingMetrics((100, 10))
    metrics.update(torch.tensor([3]))
    assert sorted(metrics.compute()) == ["hr@10", "hr@100", "mrr", "ndcg@10", "ndcg@100"]
    metrics.reset()
    metrics.update(torch.tensor([50]))
    assert float(metrics.compute()["hr@10"]) == 0.0 and float(metrics.compute()["hr@100"]) == 1.0


@pytest.mark.parametrize("ks", [(), (0,), (10, 10), (2.5,), (True,)])
def test_bad_cutoffs(ks):
    with pytest.raises(ValueError, match="ks="):
        RankingMetrics(ks)


@pytest.mark.parametrize("ranks, message", [
    (torch.tensor([[1]]), "must be \\[B\\]"), (torch.tensor([1.0]), "integers"), (torch.tensor([-1]), ">= 0"),
])
def test_bad_ranks(ranks, message):
    with pytest.raises(ValueError, match=message):
        RankingMetrics().update(ranks)
