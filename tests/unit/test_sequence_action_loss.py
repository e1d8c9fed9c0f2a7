"""SequenceRanker's action-prediction loss: its value, where it applies, how it splits over ranks, and that it learns."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_recsys.data import RecBatch, slice_batch
from lightning_recsys.models import SequenceRanker
from lightning_recsys.models.sequence_ops import action_prediction_loss, newest_padded

from test_sequence_model import SMALL, sequence_batch

POSITIVE = [1, 2]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def model_with_loss(weight: float = 2.0, **overrides: object) -> SequenceRanker:
    torch.manual_seed(0)
    return SequenceRanker(**{**SMALL, "action_loss_weight": weight, "positive_actions": POSITIVE, **overrides})  # type: ignore[arg-type]


def loop_loss(items: torch.Tensor, actions: list[list[int]], scale: float, bias: float) -> torch.Tensor:
    """The loss written out per example and item: leave-one-out mean of the other positive items."""
    per_example = []
    for example, acts in enumerate(actions):
        rows = items[example, len(items[example]) - len(acts) :]  # right-aligned, newest last
        positive = [a in POSITIVE for a in acts]
        losses = []
        for i, row in enumerate(rows):
            others = [rows[j] for j in range(len(rows)) if j != i and positive[j]]
            if not others:
                continue
            logit = scale * torch.dot(row, torch.stack(others).mean(0)) + bias
            losses.append(F.binary_cross_entropy_with_logits(logit, torch.tensor(float(positive[i]))))
        per_example.append(torch.stack(losses).mean() if losses else torch.tensor(0.0))
    return torch.stack(per_example).mean()


def test_the_loss_is_the_per_example_mean_of_each_items_leave_one_out_prediction():
    actions = [[1, 0, 2, 1], [0, 2], [0, 0, 1], [], [2, 2, 0]]
    lengths = torch.tensor([len(a) for a in actions])
    values = torch.randn(int(lengths.sum()), 6, generator=torch.Generator().manual_seed(3))
    items, padding = newest_padded(lengths, values, 4)
    ids, _ = newest_padded(lengths, torch.tensor([a for acts in actions for a in acts])[:, None], 4)
    loss = action_prediction_loss(items, ids.squeeze(-1), padding, torch.tensor(POSITIVE), torch.tensor(0.7), torch.tensor(-0.2))
    # Example 1: one positive, no other positive beside it, only the non-positive item is scored;
    # example 2: the only positive has no other, the two zeros are scored against it; 3 has no history.
    torch.testing.assert_close(loss, loop_loss(items, actions, 0.7, -0.2))


def test_training_adds_the_weighted_action_loss_and_logs_its_parts():
    model = model_with_loss(weight=2.0).train()
    batch = sequence_batch([[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]], actions=[[1, 0, 2, 1, 1], [2, 2], [0, 1, 2]])
    torch.manual_seed(5)
    losses = model.training_losses(batch)
    assert set(losses) == {"loss", "click_loss", "action_loss"}
    torch.testing.assert_close(losses["loss"], losses["click_loss"] + 2.0 * losses["action_loss"])
    torch.testing.assert_close(losses["click_loss"], F.binary_cross_entropy_with_logits(model(batch), batch.labels))
    assert losses["action_loss"] > 0
    losses["loss"].backward()
    item_grad = model.sequence_embeddings.embeddings["item"].weight.grad
    # Only the kept history items (max_history=4) of examples with a positive get the action loss's
    # gradient; example 0's oldest item (1) is cut, so it gets none.
    assert item_grad[[2, 3, 4, 5, 6, 7, 8, 9, 10]].abs().sum(1).gt(0).all()
    assert model.action_score.grad.abs().gt(0).all()


def test_without_the_weight_training_is_the_click_loss_alone_and_evaluation_never_changes():
    plain = SequenceRanker(**SMALL)  # type: ignore[arg-type]
    assert plain.action_score is None
    batch = sequence_batch([[1, 2], [3]], actions=[[1, 2], [0]])
    assert set(plain.train().training_losses(batch)) == {"loss"}
    with_loss, without = model_with_loss(), model_with_loss(weight=0.0, positive_actions=None)
    with torch.no_grad():
        # Same seed, same tables and layers: the loss's two scalars are the only extra parameters.
        torch.testing.assert_close(with_loss.eval()(batch), without.eval()(batch))
    assert {n for n, _ in with_loss.named_parameters()} - {n for n, _ in without.named_parameters()} == {"action_score"}


def test_the_loss_on_a_batch_is_the_mean_of_its_halves_as_data_parallel_ranks_average():
    model = model_with_loss().train()
    batch = sequence_batch(
        [[1, 2, 3], [4, 5, 6, 7], [], [8, 9], [10, 11, 12], [13]],
        actions=[[1, 1, 0], [2, 0, 0, 1], [], [1, 2], [0, 0, 1], [2]],
    )
    whole = model.training_losses(batch)["action_loss"]
    halves = [model.training_losses(slice_batch(batch, start, start + 3))["action_loss"] for start in (0, 3)]
    torch.testing.assert_close(whole, (halves[0] + halves[1]) / 2)


def test_the_action_loss_alone_groups_items_that_the_same_users_act_on_positively():
    """Items 0-9 and 10-19 are two tastes; each history mixes both and acts positively on one. Trained
    on the action loss only, items of one taste end up more alike than items of different tastes."""
    generator = torch.Generator().manual_seed(0)
    model = model_with_loss(weight=1.0, item_table_size=20).train()
    table = model.sequence_embeddings.embeddings["item"].weight
    optimizer = torch.optim.Adagrad([table, model.action_score], lr=0.3)

    def taste_similarity() -> tuple[float, float]:
        unit = F.normalize(table.detach(), dim=1)
        cosine = unit @ unit.T
        same = torch.block_diag(torch.ones(10, 10), torch.ones(10, 10)).bool() & ~torch.eye(20, dtype=torch.bool)
        return float(cosine[same].mean()), float(cosine[~same & ~torch.eye(20, dtype=torch.bool)].mean())

    before = taste_similarity()
    for _ in range(60):
        histories, actions = [], []
        for taste in torch.randint(0, 2, (32,), generator=generator).tolist():
            items = torch.randint(0, 20, (4,), generator=generator).tolist()
            histories.append(items)
            actions.append([1 if item // 10 == taste else 0 for item in items])
        loss = model.training_losses(sequence_batch(histories, actions=actions, candidates=[0] * 32))["action_loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    same, different = taste_similarity()
    assert (same - different) - (before[0] - before[1]) > 0.3, (before, (same, different))


def test_training_step_logs_every_part_and_returns_the_total(monkeypatch):
    model = model_with_loss().train()
    logged: dict[str, tuple[torch.Tensor, bool]] = {}
    monkeypatch.setattr(model, "log", lambda name, value, prog_bar=False, **kwargs: logged.update({name: (value, prog_bar)}))
    batch = sequence_batch([[1, 2, 3], [4, 5]], actions=[[1, 0, 2], [2, 2]])
    loss = model.training_step(batch, 0)
    assert set(logged) == {"train/loss", "train/click_loss", "train/action_loss"}
    assert logged["train/loss"][0] is loss and logged["train/loss"][1] and not logged["train/action_loss"][1]
    plain = SequenceRanker(**SMALL).train()  # type: ignore[arg-type]
    monkeypatch.setattr(plain, "log", lambda name, value, **kwargs: logged.update({f"plain {name}": (value, False)}))
    plain.training_step(batch, 0)
    assert {name for name in logged if name.startswith("plain")} == {"plain train/loss"}
