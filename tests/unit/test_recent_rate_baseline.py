"""RecentPositiveRateBaseline (the history-aware no-learning baseline) against values worked out by hand."""

import math

import numpy as np
import pytest

from lightning_recsys.models.baselines import RecentPositiveRateBaseline, log_loss, normalized_entropy

# Three examples' histories, oldest first: [1, 0, 1, 1], [], [0, 0].
POSITIVE = np.array([1, 0, 1, 1, 0, 0])
LENGTHS = np.array([4, 0, 2])


def test_window_keeps_the_newest_actions_and_smooths_towards_the_base_rate():
    baseline = RecentPositiveRateBaseline(window=2, strength=1.0).fit(np.array([1, 0, 0, 0]))  # p = 1/4
    rates = baseline.predict(POSITIVE, LENGTHS)
    # Newest two of [1, 0, 1, 1] are [1, 1]: (2 + 1/4) / 3. Empty: p. [0, 0]: (0 + 1/4) / 3.
    np.testing.assert_allclose(rates, [2.25 / 3, 0.25, 0.25 / 3])
    whole = RecentPositiveRateBaseline(window=None, strength=0.0).fit(np.array([1, 0, 0, 0])).predict(POSITIVE, LENGTHS)
    np.testing.assert_allclose(whole, [0.75, 0.25, 0.0])  # no smoothing; the empty history still scores p


def test_with_item_adds_the_items_rate_as_log_odds():
    labels, items = np.array([1.0, 0.0, 1.0, 0.0]), np.array([0, 0, 1, 1])  # p = 1/2: logit(p) = 0
    baseline = RecentPositiveRateBaseline(window=3, strength=2.0, with_item=True).fit(labels, items, num_items=3)
    scores = baseline.predict(POSITIVE, LENGTHS, items=np.array([0, 2, 1]))
    user = np.array([(2 + 1.0) / 5, 0.5, 1.0 / 4])  # newest 3 of [1, 0, 1, 1]: 2 positives; [0, 0]
    item = np.array([0.5, 0.5, 0.5])  # items 0 and 1: 1 of 2, smoothed to 1/2; item 2 unseen: p
    logit = np.log(user / (1 - user)) + np.log(item / (1 - item))
    np.testing.assert_allclose(scores, 1 / (1 + np.exp(-logit)))


def test_log_loss_is_the_numerator_of_normalized_entropy():
    p, y = np.array([0.9, 0.2, 0.6]), np.array([1.0, 0.0, 0.0])
    expected = -(math.log(0.9) + math.log(0.8) + math.log(0.4)) / 3
    assert log_loss(p, y) == pytest.approx(expected)
    ctr = 1 / 3
    assert normalized_entropy(p, y) == pytest.approx(expected / -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr)))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: RecentPositiveRateBaseline(window=0), "window=0 must be an integer >= 1"),
        (lambda: RecentPositiveRateBaseline(strength=-1.0), "strength=-1.0 must be >= 0"),
        (lambda: RecentPositiveRateBaseline().fit(np.array([1.0])).predict(POSITIVE, np.array([1, 1])), "add up to the 6 history flags"),
        (lambda: RecentPositiveRateBaseline(with_item=True).fit(np.array([1.0])), "with_item=True needs the training items"),
    ],
)
def test_bad_arguments_say_what_is_wrong(make, message):
    with pytest.raises(ValueError, match=message):
        make()
