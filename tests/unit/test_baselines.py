"""Popularity and user+item bias baselines on a tiny MovieLens-format split, against values worked out by hand."""

import math
from fractions import Fraction as F

import numpy as np
import pytest

from lightning_recsys.data.movielens.ratings import MovieLens100K, MovieLens100KConfig
from lightning_recsys.models.baselines import (
    PopularityBaseline,
    SmoothedRate,
    UserItemBiasBaseline,
    auc,
    normalized_entropy,
)

_FLAGS = "|".join(["0"] * 18 + ["1"])
USERS = ["1|24|M|technician|85711", "2|53|F|other|94043", "3|23|M|writer|32067"]
ITEMS = [f"{i}|Movie {i} (1995)|01-Jan-1995||http://x/{i}|{_FLAGS}" for i in range(1, 5)]
# user, item, rating (>= 4 is a positive), timestamp
BASE = ["1\t1\t5\t1", "1\t2\t2\t2", "2\t1\t4\t3", "2\t3\t1\t4", "3\t2\t5\t5", "3\t3\t2\t6", "3\t1\t4\t7"]
TEST = ["1\t3\t4\t8", "2\t2\t1\t9", "3\t1\t2\t10", "1\t4\t5\t11", "3\t2\t5\t12"]


@pytest.fixture
def split(tmp_path):
    for name, lines in {"u.user": USERS, "u.item": ITEMS, "u1.base": BASE, "u1.test": TEST, "u.data": BASE + TEST}.items():
        (tmp_path / name).write_text("".join(line + "\n" for line in lines))
    data = MovieLens100K(MovieLens100KConfig(path=str(tmp_path), split="u1", val_fraction=0.0, num_users=3, num_items=4))
    return {name: np.array(data.ratings[name]) for name in ("train", "test")}  # rows: user row, item row, label


def _columns(ratings):
    return ratings[:, 0].astype(int), ratings[:, 1].astype(int), ratings[:, 2]


def test_smoothed_rates_by_hand(split):
    users, items, labels = _columns(split["train"])
    # 7 ratings, 4 positive: p = 4/7. With strength 1: (positives + p) / (ratings + 1).
    item = SmoothedRate.fit(items, labels, num_keys=4, strength=1.0)
    p = F(4, 7)
    expected_items = [(3 + p) / 4, (1 + p) / 3, (0 + p) / 3, p]  # item 4 is never rated: the base rate
    np.testing.assert_allclose(item.rates, [float(x) for x in expected_items])
    assert item.base_rate == pytest.approx(4 / 7) and item.counts.tolist() == [3, 2, 2, 0]
    user = SmoothedRate.fit(users, labels, num_keys=3, strength=1.0)
    np.testing.assert_allclose(user.rates, [float((1 + p) / 3), float((1 + p) / 3), float((2 + p) / 4)])
    raw = SmoothedRate.fit(items, labels, num_keys=4, strength=0.0)  # no smoothing: plain rates, unseen -> p
    np.testing.assert_allclose(raw.rates, [1.0, 0.5, 0.0, 4 / 7])
    np.testing.assert_allclose(item(np.array([3, 7, -1])), [4 / 7] * 3)  # unseen or out of range: the base rate


def test_popularity_and_bias_predictions_and_scores_by_hand(split):
    users, items, labels = _columns(split["train"])
    t_users, t_items, t_labels = _columns(split["test"])
    assert t_labels.tolist() == [1, 0, 0, 1, 1]
    p = F(4, 7)
    r_item = [(3 + p) / 4, (1 + p) / 3, p / 3, p]  # 25/28, 11/21, 4/21, 4/7
    r_user = [(1 + p) / 3, (1 + p) / 3, (2 + p) / 4]  # 11/21, 11/21, 9/14

    popularity = PopularityBaseline(strength=1.0).fit(items, labels, num_items=4)
    pop = popularity.predict(t_items)
    np.testing.assert_allclose(pop, [float(r_item[i]) for i in t_items.tolist()])
    # Positives score 4/21, 4/7, 11/21; negatives 11/21, 25/28: of the 6 pairs, one is won and one tied.
    assert auc(pop, t_labels) == pytest.approx(1.5 / 6)

    bias = UserItemBiasBaseline(strength=1.0).fit(users, items, labels, num_users=3, num_items=4)
    got = bias.predict(t_users, t_items)
    odds = lambda q: q / (1 - q)  # noqa: E731
    expected = [odds(r_user[u]) * odds(r_item[i]) / odds(p) for u, i in zip(t_users.tolist(), t_items.tolist())]
    # e.g. user 3, item 1: (9/5) * (25/3) / (4/3) = 45/4, a probability of 45/49.
    assert expected[2] == F(45, 4)
    np.testing.assert_allclose(got, [float(o / (1 + o)) for o in expected])
    # Positives 33/203, 11/21, 297/497 against negatives 363/763, 45/49: two of six pairs won.
    assert auc(got, t_labels) == pytest.approx(2 / 6)

    # NE: mean log loss over the entropy of the test labels' own rate (3/5).
    logloss = -np.mean([math.log(q) if y else math.log(1 - q) for q, y in zip(pop, t_labels)])
    entropy = -(0.6 * math.log(0.6) + 0.4 * math.log(0.4))
    assert normalized_entropy(pop, t_labels) == pytest.approx(logloss / entropy)
    assert normalized_entropy(np.full(5, 0.6), t_labels) == pytest.approx(1.0)
    assert math.isnan(normalized_entropy(np.full(2, 0.5), np.ones(2)))


def test_fit_checks_its_input():
    with pytest.raises(ValueError, match=r"keys must be in \[0, num_keys=2\)"):
        SmoothedRate.fit(np.array([0, 2]), np.array([1, 0]), num_keys=2, strength=1.0)
    with pytest.raises(ValueError, match="no training examples"):
        SmoothedRate.fit(np.array([], dtype=int), np.array([]), num_keys=2, strength=1.0)
    with pytest.raises(ValueError, match="strength=-1 must be >= 0"):
        SmoothedRate.fit(np.array([0]), np.array([1]), num_keys=2, strength=-1)
    with pytest.raises(RuntimeError, match="before fit"):
        PopularityBaseline().predict(np.array([0]))


@pytest.mark.parametrize(
    ("probabilities", "labels", "warning"),
    [
        ([0.1, 0.5, 0.7], [0, 0, 0], "every label is 0"),
        ([0.1, 0.5, 0.7], [1, 1, 1], "every label is 1"),
        ([0.1, math.nan, 0.7], [0, 1, 0], "NaN predictions"),
    ],
)
def test_baseline_auc_is_nan_where_it_is_undefined(probabilities, labels, warning):
    # torchmetrics' binary_auroc gave 0.0 for one class and 1.0 with a NaN prediction: plausible numbers
    # for an undefined AUC, unlike the rankers' val/auc that the baselines are compared with.
    with pytest.warns(UserWarning, match=warning):
        assert math.isnan(auc(np.array(probabilities), np.array(labels)))


def test_baseline_auc_is_the_rankers_auc_with_ties():
    probabilities = np.array([0.2, 0.2, 0.9, 0.4, 0.4, 0.1])
    labels = np.array([1, 0, 1, 0, 1, 0])
    # Positives 0.2, 0.9, 0.4 against negatives 0.2, 0.4, 0.1: 6 pairs won and 2 tied of 9.
    assert auc(probabilities, labels) == pytest.approx(7 / 9)
