"""SequenceRanker's ``action_shares``: each action's share of the kept history and its log1p count, beside the dense features."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_recsys.data import RecBatch
from lightning_recsys.models import SequenceRanker
from lightning_recsys.models.sequence_ops import action_shares

from test_sequence_model import SMALL, sequence_batch

NUM_ACTIONS = SMALL["num_action_types"]
DENSE = SMALL["num_dense_features"]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def small_model(**overrides: object) -> SequenceRanker:
    torch.manual_seed(0)
    return SequenceRanker(**{**SMALL, **overrides})  # type: ignore[arg-type]


def _over_arch_input(model: SequenceRanker, batch: RecBatch) -> torch.Tensor:
    seen: list[torch.Tensor] = []
    handle = model.over_arch.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    model(batch)
    handle.remove()
    return seen[0]


def _shares_in(model: SequenceRanker, batch: RecBatch) -> torch.Tensor:
    """The shares part of the MLP input: the last ``NUM_ACTIONS + 1`` floats of the dense block (concat interaction)."""
    return _over_arch_input(model, batch)[:, -(NUM_ACTIONS + 1) :]


def test_shares_count_the_kept_slots_by_action_and_ignore_padding():
    # Padded as newest_padded lays it out: padding first (its action id 0 must not count), newest last.
    actions = torch.tensor([[0, 2, 1, 1], [0, 0, 0, 0], [0, 0, 0, 2], [1, 1, 1, 1]])
    padding = torch.tensor([[True, False, False, False], [True] * 4, [True, True, True, False], [False] * 4])
    shares = action_shares(actions, padding, NUM_ACTIONS, torch.float32)
    assert shares.shape == (4, NUM_ACTIONS + 1)
    torch.testing.assert_close(shares[0], torch.tensor([0.0, 2 / 3, 1 / 3, math.log1p(3)]))
    assert torch.equal(shares[1], torch.zeros(NUM_ACTIONS + 1))  # an empty history: zeros and log1p(0) = 0
    torch.testing.assert_close(shares[2], torch.tensor([0.0, 0.0, 1.0, math.log1p(1)]))
    torch.testing.assert_close(shares[3], torch.tensor([0.0, 1.0, 0.0, math.log1p(4)]))
    non_empty = ~padding.all(dim=1)
    torch.testing.assert_close(shares[non_empty, :NUM_ACTIONS].sum(dim=1), torch.ones(int(non_empty.sum())))


def test_the_model_reads_the_shares_of_the_newest_max_history_items_only():
    model = small_model(action_shares=True).eval()
    assert model.over_arch[0].in_features == small_model().over_arch[0].in_features + NUM_ACTIONS + 1
    # max_history is 4: example 0 keeps actions 0, 1, 1, 0 (its oldest, action 2, is cut); example 1 is empty.
    batch = sequence_batch([[1, 3, 4, 5, 6], [], [7, 8]], actions=[[2, 0, 1, 1, 0], [], [2, 2]])
    with torch.no_grad():
        shares = _shares_in(model, batch)
    torch.testing.assert_close(shares[0], torch.tensor([0.5, 0.5, 0.0, math.log1p(4)]))
    assert torch.equal(shares[1], torch.zeros(NUM_ACTIONS + 1))
    torch.testing.assert_close(shares[2], torch.tensor([0.0, 0.0, 1.0, math.log1p(2)]))
    torch.testing.assert_close(shares[[0, 2], :NUM_ACTIONS].sum(dim=1), torch.ones(2))
    # The dense features come first in the dense block, unchanged.
    with torch.no_grad():
        dense = _over_arch_input(model, batch)[:, -(NUM_ACTIONS + 1 + DENSE) : -(NUM_ACTIONS + 1)]
    assert torch.equal(dense, batch.dense)


def test_a_dropped_history_gives_the_shares_of_an_empty_one():
    model = small_model(action_shares=True, history_dropout=0.5).train()
    batch = sequence_batch([[1, 2, 3]] * 64, actions=[[1, 2, 1]] * 64, candidates=[4] * 64)
    torch.manual_seed(1)
    with torch.no_grad():
        shares = _shares_in(model, batch)
    kept = torch.tensor([0.0, 2 / 3, 1 / 3, math.log1p(3)])
    as_kept = torch.isclose(shares, kept).all(dim=1)
    as_empty = (shares == 0).all(dim=1)
    assert torch.all(as_kept ^ as_empty)
    assert 16 < int(as_empty.sum()) < 48


def test_the_shares_change_the_logits_and_reach_the_dot_interaction():
    batch = sequence_batch([[1, 2, 3], [4], []], actions=[[0, 0, 1], [2], []])
    for interaction in ("concat", "dot"):
        model = small_model(action_shares=True, action_means=True, interaction=interaction).eval()
        with torch.no_grad():
            logits = model(batch)
            # Same weights, other actions with the same items: the shares (and the action embeddings) differ.
            other = model(sequence_batch([[1, 2, 3], [4], []], actions=[[2, 2, 2], [1], []]))
        assert not torch.allclose(logits[:2], other[:2])
    # With "dot" the shares join the dense projection's input (and so the pairwise dots).
    dot = small_model(action_shares=True, interaction="dot", num_dense_features=0)
    assert dot.dense_projection is not None and dot.dense_projection.in_features == NUM_ACTIONS + 1
    logits = dot.train()(RecBatch(torch.zeros(3, 0), batch.sparse, batch.labels))
    torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels).backward()
    assert dot.dense_projection.weight.grad.abs().sum() > 0
    # Wired in: zeroing the over-arch's weights on the shares changes nothing else, and the logits move.
    model = small_model(action_shares=True).eval()
    with torch.no_grad():
        before = model(batch)
        model.over_arch[0].weight[:, -(NUM_ACTIONS + 1) :] = 0.0
        assert not torch.allclose(before[:2], model(batch)[:2])


@pytest.mark.parametrize("overrides", [{}, {"action_means": True, "interaction": "dot"}], ids=["concat", "dot"])
def test_off_by_default_adds_no_parameter_and_keeps_the_logits(overrides):
    default = small_model(**overrides).eval()
    off = small_model(action_shares=False, **overrides).eval()
    on = small_model(action_shares=True, **overrides)
    shapes = {k: v.shape for k, v in default.state_dict().items()}
    assert {k: v.shape for k, v in off.state_dict().items()} == shapes
    assert all(torch.equal(v, off.state_dict()[k]) for k, v in default.state_dict().items())
    batch = sequence_batch([[1, 2, 3], [4], []])
    with torch.no_grad():
        assert torch.equal(default(batch), off(batch))
    # On: the same keys, only the layers that read the dense block are wider (no new parameters).
    assert set(on.state_dict()) == set(shapes)
    wider = {k for k, v in on.state_dict().items() if v.shape != shapes[k]}
    assert wider == {"over_arch.0.weight"} | ({"dense_projection.weight"} if "interaction" in overrides else set())


def test_action_shares_is_validated_and_refused_with_the_sasrec_encoder():
    with pytest.raises(ValueError, match=r"action_shares=1 must be True or False"):
        small_model(action_shares=1)
    with pytest.raises(ValueError, match=r"action_shares=True: TransAct encoder option"):
        small_model(action_shares=True, sequence_encoder="sasrec", newest_tokens=None)
