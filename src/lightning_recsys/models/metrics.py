"""Ranking metrics as torchmetrics Metrics (they sync across ranks through torchmetrics)."""

from __future__ import annotations

import torch
from torchmetrics import Metric
from torchmetrics.utilities import rank_zero_warn


def _flatten_logits_and_labels(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached float64 ``[N]`` views of a batch's logits and labels (float64: the sums run over a whole epoch)."""
    logits, labels = logits.detach().reshape(-1).double(), labels.detach().reshape(-1).double()
    if logits.shape != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} must have the same size.")
    return logits, labels


def _cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed binary cross-entropy from logits, ``y * softplus(-x) + (1 - y) * softplus(x)``, exact for infinite logits.

    Each term is left out where its label weight is 0: ``F.binary_cross_entropy_with_logits`` computes
    ``(1 - y) * x``, which is ``0 * inf = NaN`` for a logit of +inf on a click (or -inf on a
    non-click), an example that costs 0. On the wrong side the loss is +inf, as it is.
    """
    zero = torch.zeros_like(logits)
    positive = torch.where(labels != 0, labels * torch.logaddexp(zero, -logits), zero)
    negative = torch.where(labels != 1, (1 - labels) * torch.logaddexp(zero, logits), zero)
    return (positive + negative).sum()


def _rank_auc(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """ROC AUC as the Mann-Whitney statistic: the share of (positive, negative) pairs ranked right, ties 1/2."""
    order = scores.argsort()
    _, group, counts = torch.unique_consecutive(scores[order], return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    ranks = (ends - (counts.double() - 1) / 2)[group]  # 1-based, tied scores share their average rank
    positives = labels.sum()
    negatives = labels.numel() - positives
    return ((ranks * labels[order]).sum() - positives * (positives + 1) / 2) / (positives * negatives)


class AUC(Metric):
    """ROC AUC of logits against 0/1 labels, exact over every example seen (synced across ranks).

    Ranks the logits themselves in float64: AUC depends only on their order, and a float32
    ``sigmoid`` (what ``BinaryAUROC(sigmoid(logits))`` sees) rounds every logit above ~16.6 to 1.0
    and ties the confident predictions. Takes logits; probabilities give the same value. Undefined
    cases return NaN with a warning, like NE and calibration: no example, only one class, a NaN
    logit, or a label other than 0 or 1.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    logits: list[torch.Tensor]
    labels: list[torch.Tensor]

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.add_state("logits", default=[], dist_reduce_fx="cat")
        self.add_state("labels", default=[], dist_reduce_fx="cat")
        self.set_dtype(torch.float64)  # an empty rank's placeholder in the sync then matches the others' float64

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        logits, labels = _flatten_logits_and_labels(logits, labels)
        self.logits.append(logits)
        self.labels.append(labels)

    def compute(self) -> torch.Tensor:
        logits, labels = _concatenated(self.logits), _concatenated(self.labels)
        nan = torch.tensor(float("nan"), dtype=torch.float64)
        if logits.numel() == 0:
            rank_zero_warn("AUC.compute() was called before any update; returning NaN.")
            return nan
        if torch.isnan(logits).any():
            rank_zero_warn(f"AUC is undefined with NaN predictions ({int(torch.isnan(logits).sum())} of {logits.numel()}); returning NaN.")
            return nan
        if not ((labels == 0) | (labels == 1)).all():
            other = labels[(labels != 0) & (labels != 1)][0].item()
            rank_zero_warn(f"AUC needs labels of 0 or 1, got {other:.4g}; returning NaN.")
            return nan
        positives = int(labels.sum())
        if positives in (0, labels.numel()):
            rank_zero_warn(f"AUC is undefined when every label is {int(labels[0])}; returning NaN.")
            return nan
        return _rank_auc(logits, labels)


def _concatenated(state: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """A cat state as one tensor: a list before the sync, one tensor after it."""
    if isinstance(state, torch.Tensor):
        return state.reshape(-1)
    return torch.cat(state) if state else torch.zeros(0, dtype=torch.float64)


class _LabelRange:
    """Mixin for the sum-based metrics: the smallest and largest label seen (synced by min and max), and
    the NaN logits seen (synced by sum).

    Their sums mean nothing for a label outside [0, 1] (-1/+1 labels, raw ratings): ``compute``
    then warns, naming the label and the fix, and returns NaN instead of a plausible number.
    Soft labels inside [0, 1] are fine (binary cross-entropy and click counts take them). A NaN logit
    makes the sums NaN too: ``compute`` then warns with the count of NaN logits.
    """

    label_min: torch.Tensor
    label_max: torch.Tensor
    nan_logits: torch.Tensor
    logits_seen: torch.Tensor

    def _add_label_range_states(self) -> None:
        add_state = self.add_state  # type: ignore[attr-defined]
        add_state("label_min", default=torch.tensor(float("inf"), dtype=torch.float64), dist_reduce_fx="min")
        add_state("label_max", default=torch.tensor(float("-inf"), dtype=torch.float64), dist_reduce_fx="max")

    def _update_label_range(self, labels: torch.Tensor) -> None:
        if labels.numel():
            # min/max of a tensor with a NaN are NaN, and torch.minimum/maximum keep it.
            self.label_min = torch.minimum(self.label_min, labels.min())
            self.label_max = torch.maximum(self.label_max, labels.max())

    def _add_nan_logit_states(self) -> None:
        add_state = self.add_state  # type: ignore[attr-defined]
        for name in ("nan_logits", "logits_seen"):
            add_state(name, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def _update_nan_logits(self, logits: torch.Tensor) -> None:
        self.nan_logits += torch.isnan(logits).sum()
        self.logits_seen += logits.numel()

    def _logits_were_nan(self) -> bool:
        """Warn and say so when a logit seen was NaN: the sums are then NaN, and the warning says why."""
        nan = int(self.nan_logits.item())
        if not nan:
            return False
        rank_zero_warn(
            f"{type(self).__name__} saw {nan} NaN logits of {int(self.logits_seen.item())} (summed over ranks); returning "
            "NaN. The model's output is NaN, usually after training diverged (inf/NaN weights or inputs): lower the "
            "learning rates, and find the step with GuardConfig(check_finite=True)."
        )
        return True

    def _labels_out_of_range(self) -> bool:
        """Warn and say so when a label seen was outside [0, 1] or NaN."""
        low, high = self.label_min.item(), self.label_max.item()
        if low != low or high != high:
            bad = "nan"
        elif low < 0:
            bad = f"{low:.4g}"
        elif high > 1:
            bad = f"{high:.4g}"
        else:
            return False
        rank_zero_warn(
            f"{type(self).__name__} needs labels in [0, 1] (1 = click), got {bad}; returning NaN. "
            "Map the labels to 0/1 in the dataset (e.g. -1/+1 labels to 0/1, ratings to rating >= threshold)."
        )
        return True


class NormalizedEntropy(_LabelRange, Metric):
    """Normalized entropy: mean binary cross-entropy divided by the entropy of the base CTR.

    ``NE = CE(p, y) / H(mean(y))`` with ``H(q) = -(q log q + (1 - q) log(1 - q))``. 1.0 is what a
    constant predictor of the base CTR scores; lower is better. Takes logits (not probabilities).
    When every label is the same the base entropy is 0 and NE is undefined: ``compute`` warns and
    returns NaN.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    cross_entropy_sum: torch.Tensor
    label_sum: torch.Tensor
    count: torch.Tensor

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        for name in ("cross_entropy_sum", "label_sum", "count"):
            self.add_state(name, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self._add_label_range_states()
        self._add_nan_logit_states()

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        logits, labels = _flatten_logits_and_labels(logits, labels)
        self._update_label_range(labels)
        self._update_nan_logits(logits)
        self.cross_entropy_sum += _cross_entropy_sum(logits, labels)
        self.label_sum += labels.sum()
        self.count += labels.numel()

    def compute(self) -> torch.Tensor:
        if self.count == 0:
            rank_zero_warn("NormalizedEntropy.compute() was called before any update; returning NaN.")
            return torch.tensor(float("nan"), dtype=torch.float64)
        if self._labels_out_of_range() or self._logits_were_nan():
            return torch.tensor(float("nan"), dtype=torch.float64)
        ctr = self.label_sum / self.count
        if ctr <= 0 or ctr >= 1:
            rank_zero_warn(f"NormalizedEntropy is undefined when every label is {int(ctr)}; returning NaN.")
            return torch.tensor(float("nan"), dtype=torch.float64)
        base_entropy = -(ctr * torch.log(ctr) + (1 - ctr) * torch.log1p(-ctr))
        return (self.cross_entropy_sum / self.count) / base_entropy


class Calibration(_LabelRange, Metric):
    """Calibration: predicted CTR over actual CTR, ``sum(sigmoid(logits)) / sum(labels)``.

    1.0 means the model predicts as many clicks as there were; above 1 it over-predicts, below 1 it
    under-predicts. Takes logits (not probabilities). Both sums are synced across ranks before the
    division, so one rank without clicks is fine. When no label at all is positive the ratio is
    undefined (x / 0): ``compute`` warns and returns NaN rather than ``inf``, so that an empty or
    click-free evaluation cannot pass for "infinitely over-calibrated" or average into a finite number.
    """

    is_differentiable = False
    higher_is_better = None  # 1.0 is best; neither direction is better
    full_state_update = False

    prediction_sum: torch.Tensor
    label_sum: torch.Tensor

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        for name in ("prediction_sum", "label_sum"):
            self.add_state(name, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self._add_label_range_states()
        self._add_nan_logit_states()

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        logits, labels = _flatten_logits_and_labels(logits, labels)
        self._update_label_range(labels)
        self._update_nan_logits(logits)
        self.prediction_sum += torch.sigmoid(logits).sum()
        self.label_sum += labels.sum()

    def compute(self) -> torch.Tensor:
        if self._labels_out_of_range() or self._logits_were_nan():
            return torch.tensor(float("nan"), dtype=torch.float64)
        if self.label_sum <= 0:
            rank_zero_warn("Calibration is undefined when no label is positive (actual CTR is 0, or nothing was seen); returning NaN.")
            return torch.tensor(float("nan"), dtype=torch.float64)
        return self.prediction_sum / self.label_sum


class LogLoss(_LabelRange, Metric):
    """Log loss: mean binary cross-entropy over every example seen, computed stably from logits.

    Unlike averaging per-batch losses, this weighs every example equally however the batches (or
    ranks) are sized. Lower is better. ``compute`` before any update warns and returns NaN.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    cross_entropy_sum: torch.Tensor
    count: torch.Tensor

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        for name in ("cross_entropy_sum", "count"):
            self.add_state(name, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self._add_label_range_states()
        self._add_nan_logit_states()

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        logits, labels = _flatten_logits_and_labels(logits, labels)
        self._update_label_range(labels)
        self._update_nan_logits(logits)
        self.cross_entropy_sum += _cross_entropy_sum(logits, labels)
        self.count += labels.numel()

    def compute(self) -> torch.Tensor:
        if self.count == 0:
            rank_zero_warn("LogLoss.compute() was called before any update; returning NaN.")
            return torch.tensor(float("nan"), dtype=torch.float64)
        if self._labels_out_of_range() or self._logits_were_nan():
            return torch.tensor(float("nan"), dtype=torch.float64)
        return self.cross_entropy_sum / self.count
