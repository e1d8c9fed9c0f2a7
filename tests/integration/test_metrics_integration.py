"""Metrics sync across real ranks: the synced value is the single-process value over all the data."""

import math

import pytest
import torch
import torch.distributed as dist
from lightning_recsys.testing.processes import run_ranks
from torchmetrics import Metric

from lightning_recsys.models import AUC, Calibration, LogLoss, NormalizedEntropy

LOGITS = torch.tensor([1.5, -0.5, 0.3, -2.0, 0.8, -1.2])
# Rank 1 (the last three) sees no click: its own Calibration is undefined, so the synced value is only
# right if the sums are reduced before the division.
LABELS = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
METRICS: dict[str, type[Metric]] = {"auc": AUC, "ne": NormalizedEntropy, "calibration": Calibration, "logloss": LogLoss}
WORLD_SIZE = 2


# Examples per rank: even, uneven, and a rank that saw nothing (its cat state is empty).
SPLITS = {"even": (3, 3), "uneven": (4, 2), "empty": (6, 0)}


def _rank_slice(rank: int, split: str = "even") -> slice:
    sizes = SPLITS[split]
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _metrics_on_rank(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        values: dict[str, dict[str, float]] = {split: {} for split in SPLITS}
        for split in SPLITS:
            for name, metric_type in METRICS.items():
                metric = metric_type()
                if SPLITS[split][rank]:  # an empty rank never updates, as in an evaluation it got no batch of
                    metric.update(LOGITS[_rank_slice(rank, split)], LABELS[_rank_slice(rank, split)])
                values[split][name] = metric.compute().item()
        # A label of 2 on rank 1 only: every rank's synced value must be NaN, not rank 0's sums alone.
        values["bad_label_on_rank_1"] = {}
        for name, metric_type in METRICS.items():
            metric = metric_type()
            labels = LABELS[_rank_slice(rank)].clone()
            if rank == 1:
                labels[0] = 2.0
            metric.update(LOGITS[_rank_slice(rank)], labels)
            values["bad_label_on_rank_1"][name] = metric.compute().item()
        return values
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def all_synced() -> list[dict[str, dict[str, float]]]:
    # One spawn for all metrics and splits: process start-up dominates on a 2-core machine.
    return run_ranks(_metrics_on_rank, WORLD_SIZE, timeout=60)


@pytest.fixture(scope="module")
def synced(all_synced) -> list[dict[str, float]]:
    return [values["even"] for values in all_synced]


def _single_process(name: str, part: slice = slice(None)) -> float:
    metric = METRICS[name]()
    metric.update(LOGITS[part], LABELS[part])
    return metric.compute().item()


@pytest.mark.parametrize("name", list(METRICS))
def test_metric_syncs_across_ranks(synced, name):
    expected = _single_process(name)
    assert math.isfinite(expected)
    local_only = _single_process(name, _rank_slice(0))
    assert abs(local_only - expected) > 1e-3  # the test would notice a missing sync
    assert [values[name] for values in synced] == pytest.approx([expected] * WORLD_SIZE, rel=1e-12)


@pytest.mark.parametrize("split", ["uneven", "empty"])
@pytest.mark.parametrize("name", list(METRICS))
def test_metric_syncs_uneven_and_empty_ranks(all_synced, name, split):
    expected = _single_process(name)
    assert [values[split][name] for values in all_synced] == pytest.approx([expected] * WORLD_SIZE, rel=1e-12)


def test_calibration_is_defined_when_only_one_rank_saw_a_click(synced):
    with pytest.warns(UserWarning, match="no label is positive"):
        assert math.isnan(_single_process("calibration", _rank_slice(1)))  # rank 1 alone
    assert all(math.isfinite(values["calibration"]) for values in synced)


@pytest.mark.parametrize("name", list(METRICS))
def test_a_label_outside_0_1_on_one_rank_makes_every_rank_nan(all_synced, name):
    assert all(math.isnan(values["bad_label_on_rank_1"][name]) for values in all_synced)


def _nan_logit_on_rank_1(rank: int, world_size: int) -> dict[str, tuple[float, list[str]]]:
    import warnings

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        values = {}
        for name in ("ne", "calibration", "logloss"):
            metric = METRICS[name]()
            logits = LOGITS[_rank_slice(rank)].clone()
            if rank == 1:
                logits[1] = math.nan
            metric.update(logits, LABELS[_rank_slice(rank)])
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                value = metric.compute().item()
            values[name] = (value, [str(w.message) for w in caught])
        return values
    finally:
        dist.destroy_process_group()


def test_a_nan_logit_on_one_rank_is_counted_and_named_on_rank_0():
    results = run_ranks(_nan_logit_on_rank_1, WORLD_SIZE, timeout=60)
    for name, metric_type in METRICS.items():
        if name == "auc":
            continue
        assert all(math.isnan(r[name][0]) for r in results), name
        assert any(f"{metric_type.__name__} saw 1 NaN logits of 6" in m for m in results[0][name][1]), results[0][name][1]
