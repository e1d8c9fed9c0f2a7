"""Ranking metrics as torchmetrics Metrics (they sync across ranks through torchmetrics)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchmetrics import Metric
from torchmetrics.utilities import rank_zero_warn


def _flatten_logits_and_labels(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached float64 ``[N]`` views of a batch's logits and labels (float64: the sums run over a whole epoch)."""
    logits, labels = logits.detach().reshape(-1).double(), labels.detach().reshape(-1).double()
    if logits.shape != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} must have the same size.")
    return logits, labels


class NormalizedEntropy(Metric):
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

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        logits, labels = _flatten_logits_and_labels(logits, labels)
        self.cross_entropy_sum += F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
        self.label_sum += labels.sum()
        self.count += labels.numel()

    def compute(self) -> torch.Tensor:
        if self.count == 0:
            rank_zero_warn("NormalizedEntropy.compute() was called before any update; returning NaN.")
            return torch.tensor(float("nan"), dtype=torch.float64)
        ctr = self.label_sum / self.count
        if ctr <= 0 or ctr >= 1:
            rank_zero_warn(f"NormalizedEntropy is undefined when every label is {int(ctr)}; returning NaN.")
            return torch.tensor(float("nan"), dtype=torch.float64)
        base_entropy = -(ctr * torch.log(ctr) + (1 - ctr) * torch.log1p(-ctr))
        return (self.cross_entropy_sum / self.count) / base_entropy


class Calibration(Metric):
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

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        logits, labels = _flatten_logits_and_labels(logits, labels)
        self.prediction_sum += torch.sigmoid(logits).sum()
        self.label_sum += labels.sum()

    def compute(self) -> torch.Tensor:
        if self.label_sum <= 0:
            rank_zero_warn("Calibration is undefined when no label is positive (actual CTR is 0, or nothing was seen); returning NaN.")
            return torch.tensor(float("nan"), dtype=torch.float64)
        return self.prediction_sum / self.label_sum


class LogLoss(Metric):
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

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        logits, labels = _flatten_logits_and_labels(logits, labels)
        self.cross_entropy_sum += F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
        self.count += labels.numel()

    def compute(self) -> torch.Tensor:
        if self.count == 0:
            rank_zero_warn("LogLoss.compute() was called before any update; returning NaN.")
            return torch.tensor(float("nan"), dtype=torch.float64)
        return self.cross_entropy_sum / self.count
