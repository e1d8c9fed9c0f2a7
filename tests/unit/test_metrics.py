import math
from typing import Literal

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer

from lightning_recsys.data import SyntheticClickLogConfig, SyntheticClickLogDataModule
from lightning_recsys.models import Calibration, DLRMRanker, LogLoss, NormalizedEntropy
from lightning_recsys.models.base import evaluation_loss


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


# Logits whose probabilities are round numbers, so the expected values can be written out by hand.
_PROBS = [0.5, 0.75, 0.25, 0.9]
_LOGITS = torch.tensor([math.log(p / (1 - p)) for p in _PROBS], dtype=torch.float64)  # float32 would cost 1e-8
_LABELS = torch.tensor([1.0, 1.0, 0.0, 0.0])


def test_calibration_matches_hand_computation():
    # predicted clicks 0.5 + 0.75 + 0.25 + 0.9 = 2.4, actual clicks 1 + 1 + 0 + 0 = 2, so 2.4 / 2 = 1.2.
    expected = (0.5 + 0.75 + 0.25 + 0.9) / (1 + 1 + 0 + 0)
    metric = Calibration()
    metric.update(_LOGITS[:1], _LABELS[:1])  # uneven batches: the sums, not per-batch ratios, are kept
    metric.update(_LOGITS[1:], _LABELS[1:])
    assert metric.compute().item() == pytest.approx(expected, rel=1e-12)


def test_calibration_of_base_rate_predictor_is_one_and_tracks_over_prediction():
    labels = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    ctr = labels.mean().item()
    metric = Calibration()
    metric.update(torch.full_like(labels, math.log(ctr / (1 - ctr))), labels)
    assert metric.compute().item() == pytest.approx(1.0, rel=1e-6)
    # Predicting twice the base rate for every example over-predicts by 2x.
    doubled = Calibration()
    doubled.update(torch.full_like(labels, math.log(2 * ctr / (1 - 2 * ctr))), labels)
    assert doubled.compute().item() == pytest.approx(2.0, rel=1e-6)


def test_calibration_is_nan_without_positive_labels():
    metric = Calibration()
    metric.update(torch.tensor([0.3, -1.0]), torch.zeros(2))
    with pytest.warns(UserWarning, match="undefined when no label is positive"):
        assert math.isnan(metric.compute().item())
    with pytest.warns(UserWarning, match="undefined when no label is positive"):
        assert math.isnan(Calibration().compute().item())  # nothing seen at all


def test_log_loss_matches_hand_computation_and_weighs_examples_not_batches():
    # -(ln 0.5 + ln 0.75 + ln(1 - 0.25) + ln(1 - 0.9)) / 4, one term per example.
    expected = -(math.log(0.5) + math.log(0.75) + math.log(0.75) + math.log(0.1)) / 4
    metric = LogLoss()
    metric.update(_LOGITS[:1], _LABELS[:1])
    metric.update(_LOGITS[1:], _LABELS[1:])
    assert metric.compute().item() == pytest.approx(expected, rel=1e-12)
    mean_of_batch_means = (-math.log(0.5) + -(math.log(0.75) + math.log(0.75) + math.log(0.1)) / 3) / 2
    assert abs(mean_of_batch_means - expected) > 1e-2  # what a per-batch average would have logged


def test_log_loss_is_finite_for_saturated_logits():
    # sigmoid(100) rounds to 1.0 in float32, so log(1 - p) would be -inf; from logits it is exactly 100.
    metric = LogLoss()
    metric.update(torch.tensor([100.0, 100.0, -100.0, -100.0]), torch.tensor([1.0, 0.0, 0.0, 1.0]))
    assert metric.compute().item() == pytest.approx((0 + 100 + 0 + 100) / 4, rel=1e-9)


def test_log_loss_over_base_entropy_is_normalized_entropy():
    log_loss, ne = LogLoss(), NormalizedEntropy()
    log_loss.update(_LOGITS, _LABELS)
    ne.update(_LOGITS, _LABELS)
    base_entropy = math.log(2)  # the CTR is 0.5
    assert log_loss.compute().item() / base_entropy == pytest.approx(ne.compute().item(), rel=1e-12)


def test_log_loss_is_nan_before_any_update():
    with pytest.warns(UserWarning, match="before any update"):
        assert math.isnan(LogLoss().compute().item())


@pytest.mark.parametrize("metric_type", [Calibration, LogLoss, NormalizedEntropy])
def test_metrics_reject_logits_and_labels_of_different_sizes(metric_type):
    with pytest.raises(ValueError, match=r"logits \(3,\) and labels \(2,\) must have the same size"):
        metric_type().update(torch.zeros(3), torch.zeros(2))


def _evaluate_small_ranker(cls: type[DLRMRanker], stage: Literal["val", "test"], *, num_batches: int) -> tuple[DLRMRanker, dict, list]:
    """One validate/test epoch of a small ``cls`` ranker on one process: the model, what it logged, the batches."""
    config = SyntheticClickLogConfig(
        table_sizes=[30, 40], num_dense_features=3, global_batch_size=64, val_batches=num_batches, test_batches=num_batches
    )
    torch.manual_seed(0)
    model = cls(table_sizes=config.table_sizes, num_dense_features=3, embedding_dim=8, dense_arch_layer_sizes=[8])
    data = SyntheticClickLogDataModule.from_config(config)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    run = trainer.validate if stage == "val" else trainer.test
    logged = run(model, datamodule=data, verbose=False)[0]
    return model, logged, [data.log.global_batch(stage, i) for i in range(num_batches)]


def _logged_and_expected(stage: Literal["val", "test"]) -> tuple[dict[str, float], dict[str, float]]:
    """Run one validate/test epoch of a small DLRMRanker; return what it logged and what it should have."""
    model, logged, batches = _evaluate_small_ranker(DLRMRanker, stage, num_batches=3)
    with torch.no_grad():
        logits = torch.cat([model(b) for b in batches]).double()
    labels = torch.cat([b.labels for b in batches]).double()
    expected = {
        f"{stage}/calibration": (torch.sigmoid(logits).sum() / labels.sum()).item(),
        f"{stage}/logloss": F.binary_cross_entropy_with_logits(logits, labels).item(),
    }
    return logged, expected


@pytest.mark.parametrize("stage", ["val", "test"])
def test_ranker_logs_calibration_and_log_loss_per_epoch(stage):
    logged, expected = _logged_and_expected(stage)
    assert {f"{stage}/{name}" for name in ("loss", "auc", "ne", "calibration", "logloss")} <= set(logged)
    for name, value in expected.items():
        assert logged[name] == pytest.approx(value, rel=1e-5), name


def _pair_count_auc(scores: list[float], labels: list[float]) -> float:
    pairs = [(p, n) for p, yp in zip(scores, labels) if yp for n, yn in zip(scores, labels) if not yn]
    return sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in pairs) / len(pairs)


def test_ranker_auc_ranks_confident_logits_that_a_float32_sigmoid_would_tie():
    # Every logit is above 16.6, where float32 sigmoid rounds to 1.0: AUC of sigmoid(logits) was 0.5.
    logits = torch.tensor([30.0, 18.0, 25.0, 17.0, 20.0, 19.0])
    labels = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    auc = DLRMRanker(table_sizes=[4]).metrics["val_auc"]
    auc.update(logits, labels)
    assert auc.compute().item() == pytest.approx(_pair_count_auc(logits.tolist(), labels.tolist()), rel=1e-12)


class _ConfidentDLRM(DLRMRanker):
    def forward(self, batch):
        # Informative (the labels nudge the logits) and confident: every probability rounds to 1.0 in float32.
        return super().forward(batch) * 10 + 40 + batch.labels


def test_validate_logs_the_auc_of_the_logits_not_of_their_float32_sigmoid():
    config = SyntheticClickLogConfig(table_sizes=[30, 40], num_dense_features=3, global_batch_size=64, val_batches=2)
    torch.manual_seed(0)
    model = _ConfidentDLRM(table_sizes=config.table_sizes, num_dense_features=3, embedding_dim=8, dense_arch_layer_sizes=[8])
    data = SyntheticClickLogDataModule.from_config(config)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    logged = trainer.validate(model, datamodule=data, verbose=False)[0]
    batches = [data.log.global_batch("val", i) for i in range(2)]
    with torch.no_grad():
        logits = torch.cat([model(b) for b in batches]).double()
    labels = torch.cat([b.labels for b in batches])
    expected = _pair_count_auc(logits.tolist(), labels.tolist())
    assert abs(expected - 0.5) > 0.02  # the test would notice every prediction tied
    assert logged["val/auc"] == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(
    ("logits", "labels", "warning"),
    [
        ([0.5, float("nan"), -1.0, 2.0], [1.0, 0.0, 0.0, 1.0], "NaN predictions"),
        ([0.5, 0.1, -1.0, 2.0], [1.0, 1.0, 1.0, 1.0], "every label is 1"),
        ([0.5, 0.1, -1.0, 2.0], [0.0, 0.0, 0.0, 0.0], "every label is 0"),
        ([0.5, 0.1, -1.0, 2.0], [2.0, 0.0, 1.0, 0.0], "labels of 0 or 1, got 2;"),
        ([0.5, 0.1, -1.0, 2.0], [0.7, 0.0, 1.0, 0.0], "labels of 0 or 1, got 0.7"),
    ],
)
def test_ranker_auc_is_nan_where_it_is_undefined(logits, labels, warning):
    # BinaryAUROC(sigmoid(logits), labels.long()) gave 0.67 with a NaN prediction, 0.0 for one class,
    # and silently truncated a soft label of 0.7 to 0.
    auc = DLRMRanker(table_sizes=[4]).metrics["val_auc"]
    auc.update(torch.tensor(logits), torch.tensor(labels))
    with pytest.warns(UserWarning, match=warning):
        assert math.isnan(auc.compute().item())


@pytest.mark.parametrize("metric_type", [Calibration, LogLoss, NormalizedEntropy])
@pytest.mark.parametrize(
    ("labels", "got"),
    [([0.0, 2.0, 1.0], "got 2"), ([0.0, -1.0, 1.0], "got -1"), ([1.0, -1.0, 1.0], "got -1"), ([0.0, float("nan"), 1.0], "got nan")],
)
def test_metrics_are_nan_with_labels_outside_0_1(metric_type, labels, got):
    # Labels of -1/+1 (the libsvm convention) or raw ratings gave plausible numbers: LogLoss 1.83 for
    # [0, -1, 1], Calibration 0.85 for [0, 2, 1]; NE said "every label is 1" of [0, 2, 1].
    metric = metric_type()
    metric.update(torch.tensor([1.0, 2.0, 3.0]), torch.tensor(labels))
    with pytest.warns(UserWarning, match=rf"needs labels in \[0, 1\].*{got}"):
        assert math.isnan(metric.compute().item())


@pytest.mark.parametrize("metric_type", [Calibration, LogLoss, NormalizedEntropy])
def test_metrics_take_soft_labels_in_0_1(metric_type):
    metric = metric_type()
    metric.update(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.0, 0.25, 1.0]))
    assert math.isfinite(metric.compute().item())


def test_log_loss_and_ne_take_infinite_logits():
    # A logit of +inf for a click (or -inf for a non-click) costs 0: F.binary_cross_entropy_with_logits
    # computes (1 - y) * x there, 0 * inf = NaN, and LogLoss and NE were NaN without a warning.
    logits = torch.tensor([float("inf"), float("-inf"), 2.0, -1.0])
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0])
    rest = -(math.log(1 - 1 / (1 + math.exp(-2.0))) + math.log(1 / (1 + math.exp(1.0))))
    log_loss, ne = LogLoss(), NormalizedEntropy()
    log_loss.update(logits, labels)
    ne.update(logits, labels)
    assert log_loss.compute().item() == pytest.approx(rest / 4, rel=1e-12)
    assert ne.compute().item() == pytest.approx(rest / 4 / math.log(2), rel=1e-12)
    # On the wrong side the loss is infinite, as it is.
    wrong = LogLoss()
    wrong.update(torch.tensor([float("inf"), 0.0]), torch.tensor([0.0, 1.0]))
    assert wrong.compute().item() == math.inf


@pytest.mark.parametrize("metric_type", [Calibration, LogLoss, NormalizedEntropy])
def test_metrics_warn_and_are_nan_with_nan_logits(metric_type):
    # A NaN logit (a diverged model) made these NaN without a word; AUC already said why.
    metric = metric_type()
    metric.update(torch.tensor([0.5, float("nan"), -1.0]), torch.tensor([1.0, 0.0, 0.0]))
    metric.update(torch.tensor([float("nan"), 2.0, float("inf")]), torch.tensor([1.0, 1.0, 1.0]))
    with pytest.warns(UserWarning, match=rf"{metric_type.__name__} saw 2 NaN logits of 6 .*check_finite=True"):
        assert math.isnan(metric.compute().item())
    metric.reset()  # the count is per epoch
    metric.update(torch.tensor([0.5, -1.0]), torch.tensor([1.0, 0.0]))
    assert math.isfinite(metric.compute().item())


class _CertainDLRM(DLRMRanker):
    def forward(self, batch):
        # Every click predicted with certainty (+inf), and half of the non-clicks (-inf): all correct.
        logits = super().forward(batch)
        certain_no = (batch.labels == 0) & (torch.arange(len(logits)) % 2 == 0)
        return torch.where(batch.labels == 1, math.inf, torch.where(certain_no, -math.inf, logits))


@pytest.mark.parametrize("stage", ["val", "test"])
def test_evaluation_loss_of_correct_infinite_logits_is_zero(stage):
    # F.binary_cross_entropy_with_logits computes (1 - y) * x: 0 * inf = NaN for +inf on a click, and
    # -inf + inf for -inf on a non-click, so {stage}/loss was NaN for a correct, certain prediction.
    model, logged, batches = _evaluate_small_ranker(_CertainDLRM, stage, num_batches=2)
    with torch.no_grad():
        logits = torch.cat([model(b) for b in batches])
    labels = torch.cat([b.labels for b in batches])
    finite = logits.isfinite()
    assert (~finite).sum() > labels.sum()  # both kinds of infinite logit are there
    expected = F.binary_cross_entropy_with_logits(logits[finite], labels[finite], reduction="sum").item() / len(labels)
    assert logged[f"{stage}/loss"] == pytest.approx(expected, rel=1e-5)
    assert logged[f"{stage}/logloss"] == pytest.approx(expected, rel=1e-5)


def test_evaluation_loss_is_exact_for_infinite_logits():
    inf, nan = math.inf, math.nan
    # Right and certain: 0. Wrong and certain: +inf (F.binary_cross_entropy_with_logits gave NaN for -inf on a click).
    assert evaluation_loss(torch.tensor([inf, -inf, 2.0]), torch.tensor([1.0, 0.0, 0.0])).item() == pytest.approx(
        F.binary_cross_entropy_with_logits(torch.tensor([2.0]), torch.tensor([0.0])).item() / 3
    )
    for logit, label in ((-inf, 1.0), (inf, 0.0), (inf, 0.5), (-inf, 0.5)):
        assert evaluation_loss(torch.tensor([logit, 0.0]), torch.tensor([label, 1.0])).item() == inf, (logit, label)
    assert math.isnan(evaluation_loss(torch.tensor([nan, 0.0]), torch.tensor([1.0, 1.0])).item())
    logits, labels = torch.randn(257) * 5, torch.bernoulli(torch.full((257,), 0.3))
    assert torch.equal(evaluation_loss(logits, labels), F.binary_cross_entropy_with_logits(logits, labels))  # finite: bit for bit
