"""SequencePretrainer on one process: the loss against a loop written out by hand, masking, padding, ranking, predict, args."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_recsys.testing.oracle.pretrain import make_batch
from torch.utils.data import DataLoader

from lightning_recsys.data.batch import SequenceBatch
from lightning_recsys.models import RankingMetrics, RecsysModule, SequencePretrainer
from lightning_recsys.models.pretrainer_ops import oldest_first_padded
from lightning_recsys.parallel.ranking import UnshardedItemRanking

ITEMS = 40


def _model(**overrides: object) -> SequencePretrainer:
    torch.manual_seed(0)
    arguments = dict(num_items=ITEMS, embedding_dim=8, max_length=5, num_layers=2, num_heads=2, dropout=0.0, init_std=0.3)
    return SequencePretrainer(**{**arguments, **overrides}).eval()  # type: ignore[arg-type]


def _weight(model: SequencePretrainer) -> torch.Tensor:
    return model.item_embeddings.embeddings["item"].weight


SEQUENCES = [[3, 7, 7, 1], [5], [], [9, 2, 4, 6, 8, 10, 12], [11, 13]]  # an empty one; one longer than max_length
POOL = [[7, 20], [30], [2, 33], [13, 1], [35]]  # 7, 2, 13 and 1 are some position's target: accidental hits


def _hand_loss(model: SequencePretrainer, batch: SequenceBatch, sequences, next_items, pool, temperature, l2, in_batch, mask=True) -> torch.Tensor:
    """The loss position by position, in plain Python loops (``mask=False``: accidental hits kept as negatives)."""
    hidden = model(batch)
    table = _weight(model)
    emb = (lambda i: F.normalize(table[i], dim=-1)) if l2 else (lambda i: table[i])
    pool_ids = [n for p in pool for n in p]
    positions = []  # (query, target id)
    for example, sequence in enumerate(sequences):
        kept = len(sequence[-model.max_length :])
        offset = len(sequence) - kept
        for t in range(kept):
            query = hidden[example, t]
            positions.append((F.normalize(query, dim=-1) if l2 else query, next_items[example][offset + t]))
    targets = [y for _, y in positions]
    losses = []
    for i, (query, target) in enumerate(positions):
        logits = [torch.dot(query, emb(target)) / temperature]
        logits += [torch.dot(query, emb(n)) / temperature for n in pool_ids if n != target or not mask]
        if in_batch:
            for j, other in enumerate(targets):
                if other != target:
                    logits.append(torch.dot(query, emb(other)) / temperature - math.log(targets.count(other) / len(targets)))
        stacked = torch.stack(logits)
        losses.append(torch.logsumexp(stacked, 0) - stacked[0])
    return torch.stack(losses).mean()


@pytest.mark.parametrize("temperature, l2, in_batch", [(1.0, False, False), (0.2, False, False), (0.5, True, False), (0.7, False, True), (1.0, True, True)])
def test_loss_equals_a_per_position_loop_with_accidental_hits_masked(temperature, l2, in_batch):
    model = _model(temperature=temperature, l2_normalize=l2, in_batch_negatives=in_batch)
    next_items = [s[1:] + [s[-1] + 1] if s else [] for s in SEQUENCES]
    batch = make_batch(SEQUENCES, next_items, POOL)
    expected = _hand_loss(model, batch, SEQUENCES, next_items, POOL, temperature, l2, in_batch)
    loss = model.training_losses(batch)["loss"]
    torch.testing.assert_close(loss, expected)
    # The hits matter: kept as negatives, they give another loss.
    unmasked = _hand_loss(model, batch, SEQUENCES, next_items, POOL, temperature, l2, in_batch, mask=False)
    assert abs(float(loss.detach()) - float(unmasked.detach())) > 1e-4


@pytest.mark.parametrize("l2", [False, True])
def test_pool_of_every_item_is_the_full_softmax(l2):
    model = _model(temperature=0.3, l2_normalize=l2)
    sequences = [[1, 2, 3], [4, 4], [7, 8, 9, 10, 11, 12]]
    everything = list(range(ITEMS))
    pool = [everything[:14], everything[14:27], everything[27:]]  # spread over the examples, as the data does
    batch = make_batch(sequences, pool=pool)
    hidden = model(batch)
    valid = oldest_first_padded(torch.tensor([3, 2, 6]), torch.zeros(11, 1), model.max_length)[1]
    queries, table = hidden[valid], _weight(model)
    if l2:
        queries, table = F.normalize(queries, dim=-1), F.normalize(table, dim=-1)
    targets = torch.tensor([2, 3, 4, 4, 5, 9, 10, 11, 12, 13])  # the kept positions' next items (the 6-long one keeps 5)
    expected = F.cross_entropy(queries @ table.T / 0.3, targets)
    torch.testing.assert_close(model.training_losses(batch)["loss"], expected)


def test_negative_gradients_reach_only_the_looked_up_rows():
    model = _model(in_batch_negatives=True).train()
    batch = make_batch([[1, 2, 3], [4, 5]], pool=[[20, 21], [22]])
    model.training_losses(batch)["loss"].backward()
    grad = _weight(model).grad
    touched = {1, 2, 3, 4, 5, 6, 20, 21, 22}  # inputs, targets (the last one: 3 + 1 and 5 + 1), negatives
    nonzero = set(torch.nonzero(grad.abs().sum(1)).flatten().tolist())
    assert nonzero == touched


def test_no_valid_position_gives_zero_loss_with_a_graph():
    model = _model().train()
    loss = model.training_losses(make_batch([[], []], pool=[[1], [2]]))["loss"]
    assert float(loss) == 0.0 and loss.requires_grad


def test_causal_a_later_item_never_changes_an_earlier_output():
    model = _model(num_action_types=2)
    actions = [[0, 1, 0, 1, 1]]
    before = model(make_batch([[1, 2, 3, 4, 5]], actions=actions))
    after = model(make_batch([[1, 2, 30, 4, 5]], actions=actions))
    torch.testing.assert_close(after[0, :2], before[0, :2], rtol=0, atol=0)
    assert not torch.allclose(after[0, 2:], before[0, 2:])
    changed_action = model(make_batch([[1, 2, 3, 4, 5]], actions=[[0, 1, 0, 0, 1]]))
    torch.testing.assert_close(changed_action[0, :3], before[0, :3], rtol=0, atol=0)
    assert not torch.allclose(changed_action[0, 3:], before[0, 3:])


def test_padding_and_batch_composition_never_change_an_example():
    model = _model()
    alone = model(make_batch([[4, 8, 15]]))[0, :3]
    with_others = model(make_batch([[1], [4, 8, 15], [16, 23, 42 % ITEMS, 5, 6, 7]]))[1, :3]
    torch.testing.assert_close(with_others, alone)
    # More padding (a longer max_length, the same weights for the first positions) changes nothing.
    longer = _model(max_length=9)
    state = model.state_dict()
    state["encoder.positions"] = torch.cat([state["encoder.positions"], longer.encoder.positions.detach()[5:]])
    longer.load_state_dict(state)
    torch.testing.assert_close(longer(make_batch([[4, 8, 15]]))[0, :3], alone)
    # An example longer than max_length reads its newest max_length items.
    cut = model(make_batch([[1, 2, 3, 4, 5, 6, 7]]))
    torch.testing.assert_close(cut, model(make_batch([[3, 4, 5, 6, 7]])))


def test_oldest_first_padded_keeps_the_newest_values_on_the_left():
    padded, valid = oldest_first_padded(torch.tensor([2, 0, 4]), torch.arange(1, 7), 3)
    assert padded.tolist() == [[1, 2, 0], [0, 0, 0], [4, 5, 6]]
    assert valid.tolist() == [[True, True, False], [False, False, False], [True, True, True]]


def _eval_batch() -> tuple[SequenceBatch, list[list[int]], list[int]]:
    sequences = [[1, 2, 3], [5], [9, 2, 4, 6, 8, 10, 12], [11, 13]]
    targets = [17, 30, 2, 13]
    next_items = [s[1:] + [t] for s, t in zip(sequences, targets)]
    seen = [s for s in sequences]
    seen[2] = seen[2] + [2]  # a seen target is still ranked
    return make_batch(sequences, next_items, seen=seen), seen, targets


def _brute_force_ranks(queries: torch.Tensor, table: torch.Tensor, targets: list[int], seen: list[list[int]]) -> torch.Tensor:
    ranks = []
    for user, target in enumerate(targets):
        scores = [float(queries[user] @ table[j]) for j in range(table.shape[0])]
        ranks.append(sum(1 for j, s in enumerate(scores) if j != target and j not in seen[user] and s >= scores[target]))
    return torch.tensor(ranks)


@pytest.mark.parametrize("l2", [False, True])
def test_evaluation_ranks_every_item_as_a_brute_force_loop(l2):
    model = _model(l2_normalize=l2, eval_k=[1, 5, 20])
    batch, seen, targets = _eval_batch()
    hidden = model(batch)
    last = torch.tensor([2, 0, 4, 1])  # each example's last kept slot
    queries = hidden[torch.arange(4), last]
    table = _weight(model).detach()
    if l2:
        queries, table = F.normalize(queries, dim=-1), F.normalize(table, dim=-1)
    expected = RankingMetrics([1, 5, 20])
    expected.update(_brute_force_ranks(queries, table, targets, seen))
    model.validation_step(batch, 0)
    got = model.ranking_metrics["val"].compute()
    for name, value in expected.compute().items():
        torch.testing.assert_close(got[name], value, msg=name)
    assert float(expected.compute()["hr@20"]) > 0  # the case ranks some target in the top 20


def test_evaluation_uses_the_strategys_ranking_when_it_has_one():
    model = _model(l2_normalize=True)
    calls = []

    class _Strategy:
        def item_ranking(self, module, table_name, normalize_rows):
            calls.append((module, table_name, normalize_rows))
            return UnshardedItemRanking(_weight(model).detach(), normalize_rows=normalize_rows)

    model._trainer = SimpleNamespace(strategy=_Strategy())
    batch, _, _ = _eval_batch()
    model.test_step(batch, 0)
    assert calls == [(model.item_embeddings, "item", True)]


def test_evaluation_refuses_an_example_without_input_items():
    model = _model()
    batch = make_batch([[1, 2], []], [[2, 3], []])
    with pytest.raises(ValueError, match="example 1 .* no input item"):
        model.validation_step(batch, 0)


def test_predict_returns_user_vectors_and_the_unseen_top_k():
    model = _model(predict_top_k=6)
    batch, seen, _ = _eval_batch()
    out = model.predict_step(batch, 0)
    assert set(out) == {"user_vectors", "top_k_ids", "top_k_scores"}
    assert out["user_vectors"].shape == (4, 8) and out["top_k_ids"].shape == (4, 6) and out["top_k_scores"].shape == (4, 6)
    scores = out["user_vectors"] @ _weight(model).detach().T
    for user in range(4):
        allowed = [j for j in range(ITEMS) if j not in seen[user]]
        best = sorted(allowed, key=lambda j: -float(scores[user, j]))[:6]
        assert out["top_k_ids"][user].tolist() == best
        torch.testing.assert_close(out["top_k_scores"][user], scores[user, best])
    assert set(_model(predict_top_k=0).predict_step(batch, 0)) == {"user_vectors"}


def test_a_predict_loop_builds_one_ranking_and_returns_what_predict_step_does(monkeypatch):
    model = _model(predict_top_k=6)
    batch, _, _ = _eval_batch()
    expected = model.predict_step(batch, 0)
    built = []
    item_ranking = model.item_ranking
    monkeypatch.setattr(model, "item_ranking", lambda: built.append(1) or item_ranking())
    loader = DataLoader([batch, batch, batch], batch_size=None)
    outputs = Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu").predict(model, loader)
    assert len(built) == 1 and len(outputs) == 3  # one ranking for the loop, not one per batch
    for out in outputs:
        torch.testing.assert_close(out["top_k_ids"], expected["top_k_ids"])
        torch.testing.assert_close(out["top_k_scores"], expected["top_k_scores"])
    assert model._evaluation_ranking is None  # dropped at the loop's end: a later fit step never ranks a stale table


def test_missing_next_item_feature_and_unaligned_lengths_are_clear_errors():
    model = _model()
    batch = make_batch([[1, 2]])
    from torchrec import KeyedJaggedTensor

    without = KeyedJaggedTensor.from_lengths_sync(keys=["item_id", "negative_item_id"], values=torch.tensor([1, 2]), lengths=torch.tensor([2, 0]))
    with pytest.raises(ValueError, match="next_item_id"):
        model.training_losses(SequenceBatch(without, batch.next_item_ids, batch.seen_ids, batch.seen_lengths))
    unaligned = KeyedJaggedTensor.from_lengths_sync(
        keys=["item_id", "next_item_id", "negative_item_id"], values=torch.tensor([1, 2, 2]), lengths=torch.tensor([2, 1, 0])
    )
    with pytest.raises(ValueError, match="'item_id' and 'next_item_id' must have the same length"):
        model.training_losses(SequenceBatch(unaligned, batch.next_item_ids, batch.seen_ids, batch.seen_lengths))


def test_tables_start_at_init_std_and_the_class_shares_the_base():
    model = SequencePretrainer(num_items=2000, num_action_types=4, embedding_dim=16, init_std=0.05)
    assert isinstance(model, RecsysModule)
    assert abs(float(_weight(model).std()) - 0.05) < 0.005
    assert abs(float(model.item_embeddings.embeddings["action"].weight.std()) - 0.05) < 0.03
    assert model.item_embeddings.embedding_configs()[0].feature_names == ["item_id", "next_item_id", "negative_item_id"]
    optimizer = model.configure_optimizers()
    assert isinstance(optimizer, torch.optim.Adam) and optimizer.defaults["lr"] == 1e-3


@pytest.mark.parametrize("overrides, match", [
    ({"num_items": 0}, "num_items=0"),
    ({"num_action_types": -1}, "num_action_types=-1"),
    ({"embedding_dim": 6, "num_heads": 4}, "num_heads=4 must divide embedding_dim=6"),
    ({"max_length": 0}, "max_length=0"),
    ({"num_layers": 1.5}, "num_layers=1.5"),
    ({"feedforward_dim": 0}, "feedforward_dim=0"),
    ({"dropout": 1.0}, "dropout=1.0"),
    ({"temperature": 0}, "temperature=0"),
    ({"temperature": float("inf")}, "temperature=inf"),
    ({"init_std": -0.1}, "init_std=-0.1"),
    ({"l2_normalize": 1}, "l2_normalize=1"),
    ({"in_batch_negatives": "yes"}, "in_batch_negatives='yes'"),
    ({"eval_k": []}, "eval_k=\\[\\]"),
    ({"eval_k": [10, 10]}, "eval_k="),
    ({"eval_k": 10}, "eval_k=10"),
    ({"predict_top_k": -1}, "predict_top_k=-1"),
    ({"predict_top_k": ITEMS + 1}, f"predict_top_k={ITEMS + 1} must be <= num_items"),
    ({"embedding_device": "nowhere"}, "embedding_device='nowhere'"),
    ({"dense_optimizer": "lamb"}, "dense_optimizer='lamb'"),
    ({"dense_lr": 0}, "dense_lr=0"),
])
def test_arguments_are_validated(overrides, match):
    with pytest.raises(ValueError, match=match):
        _model(**overrides)


class _Batches(torch.utils.data.IterableDataset):
    def __init__(self, make) -> None:
        self.make = make

    def __iter__(self):
        yield self.make()


class _RecordValidation(Callback):
    def __init__(self) -> None:
        self.ndcg: list[float] = []

    def on_validation_end(self, trainer, pl_module) -> None:  # after the module's epoch end logged the metrics
        if not trainer.sanity_checking:
            self.ndcg.append(float(trainer.callback_metrics["val/ndcg@10"]))


def test_trainer_fit_logs_ranking_metrics_and_checkpoints_on_val_ndcg(tmp_path):
    model = _model(eval_k=[1, 10], dense_lr=0.05, dense_optimizer="adam").train()
    train = DataLoader(_Batches(lambda: make_batch([[1, 2, 3], [4, 5, 6], [17, 30]], pool=[[7, 8], [9], [10, 11]])), batch_size=None)
    val = DataLoader(_Batches(lambda: _eval_batch()[0]), batch_size=None)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val/ndcg@10", mode="max", filename="{epoch}-{val/ndcg@10:.4f}", auto_insert_metric_name=False)
    record = _RecordValidation()
    trainer = Trainer(max_epochs=4, logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[checkpoint, record], accelerator="cpu")
    trainer.fit(model, train, val)
    metrics = trainer.callback_metrics
    assert {"train/loss", "val/hr@1", "val/hr@10", "val/ndcg@1", "val/ndcg@10", "val/mrr"} <= set(metrics)
    assert len(record.ndcg) == 4 and float(checkpoint.best_model_score) == pytest.approx(max(record.ndcg))
    assert f"{max(record.ndcg):.4f}" in checkpoint.best_model_path
    loaded = SequencePretrainer.load_from_checkpoint(checkpoint.best_model_path)
    (result,) = Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu").test(loaded, val, verbose=False)
    assert set(result) == {"test/hr@1", "test/hr@10", "test/ndcg@1", "test/ndcg@10", "test/mrr"}
    assert result["test/ndcg@10"] == pytest.approx(max(record.ndcg), abs=1e-6)  # the best epoch's weights


def test_learns_a_planted_next_item_chain():
    """Every user walks the chain ``i -> i + 3 (mod items)``: after a short training the next item ranks first."""
    torch.manual_seed(0)
    items = 100
    model = SequencePretrainer(num_items=items, embedding_dim=16, max_length=8, num_layers=1, dropout=0.0, dense_lr=1e-2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)  # the tables too: one process, plain torch
    generator = torch.Generator().manual_seed(1)

    def walks(count: int) -> list[list[int]]:
        starts = torch.randint(0, items, (count,), generator=generator).tolist()
        lengths = torch.randint(2, 9, (count,), generator=generator).tolist()
        return [[(s + 3 * k) % items for k in range(n + 1)] for s, n in zip(starts, lengths)]

    for _ in range(80):
        users = walks(32)
        pool = torch.randint(0, items, (32, 4), generator=generator).tolist()
        optimizer.zero_grad()
        model.training_losses(make_batch([u[:-1] for u in users], [u[1:] for u in users], pool))["loss"].backward()
        optimizer.step()
    model.eval()
    users = walks(64)
    model.validation_step(make_batch([u[:-1] for u in users], [u[1:] for u in users], seen=[u[:-1] for u in users]), 0)
    assert float(model.ranking_metrics["val"].compute()["hr@10"]) > 0.9


@pytest.mark.gpu
def test_cuda_loss_ranking_and_top_k_equal_the_cpu():
    """The sampled loss (in-batch negatives, l2) and the unsharded full ranking on CUDA, against the CPU."""
    model = _model(l2_normalize=True, in_batch_negatives=True, temperature=0.5, predict_top_k=5)
    train = make_batch(SEQUENCES, pool=POOL)
    batch, _, _ = _eval_batch()
    expected_loss = model.training_losses(train)["loss"]
    expected = model.predict_step(batch, 0)
    model.validation_step(batch, 0)
    expected_metrics = model.ranking_metrics["val"].compute()
    model.ranking_metrics["val"].reset()
    model = model.to("cuda")
    torch.testing.assert_close(model.training_losses(train.to("cuda"))["loss"].cpu(), expected_loss, rtol=1e-4, atol=1e-5)
    got = model.predict_step(batch.to("cuda"), 0)
    torch.testing.assert_close(got["user_vectors"].cpu(), expected["user_vectors"], rtol=1e-4, atol=1e-5)
    assert torch.equal(got["top_k_ids"].cpu(), expected["top_k_ids"])
    model.validation_step(batch.to("cuda"), 0)
    for name, value in model.ranking_metrics["val"].compute().items():
        torch.testing.assert_close(value.cpu(), expected_metrics[name], msg=name)
