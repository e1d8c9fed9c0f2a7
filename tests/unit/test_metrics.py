import math

import pytest
import torch

from lightning_recsys.models import DLRMRanker, NormalizedEntropy


def test_normalized_entropy_matches_hand_computation():
    logits = torch.tensor([2.0, -1.0, 0.5, -3.0])
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0])
    probs = [1 / (1 + math.exp(-z)) for z in logits.tolist()]
    cross_entropy = -sum(y * math.log(p) + (1 - y) * math.log(1 - p) for p, y in zip(probs, labels.tolist())) / 4
    ctr = 0.5
    base_entropy = -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr))
    metric = NormalizedEntropy()
    metric.update(logits[:2], labels[:2])
    metric.update(logits[2:], labels[2:])
    assert metric.compute().item() == pytest.approx(cross_entropy / base_entropy, rel=1e-9)


def test_normalized_entropy_of_base_rate_predictor_is_one():
    labels = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    ctr = labels.mean()
    metric = NormalizedEntropy()
    metric.update(torch.full_like(labels, math.log(ctr / (1 - ctr))), labels)
    assert metric.compute().item() == pytest.approx(1.0, rel=1e-6)


def test_normalized_entropy_is_nan_with_one_class():
    metric = NormalizedEntropy()
    metric.update(torch.zeros(3), torch.ones(3))
    with pytest.warns(UserWarning, match="undefined when every label is 1"):
        assert math.isnan(metric.compute().item())


def test_ranker_auc_matches_pair_count():
    model = DLRMRanker(table_sizes=[4])
    auc = model.metrics["val_auc"]
    probs = torch.tensor([0.9, 0.8, 0.3, 0.6, 0.2])
    labels = torch.tensor([1, 0, 1, 0, 0])
    pairs = [(p, n) for p, yp in zip(probs, labels) if yp for n, yn in zip(probs, labels) if not yn]
    expected = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in pairs) / len(pairs)
    auc.update(probs, labels)
    assert auc.compute().item() == pytest.approx(expected)
