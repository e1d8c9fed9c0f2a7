"""SyntheticSequenceDataModule: determinism per seed and rank, Zipf ids, lengths, and a signal only the history reveals."""

import pytest
import torch
from torchmetrics.functional.classification import binary_auroc

from lightning_recsys.data import SyntheticSequenceConfig, SyntheticSequenceDataModule, SyntheticSequenceLog, slice_batch
from lightning_recsys.data.synthetic.click_log import SyntheticClickLogDataset

SMALL = dict(num_items=240, num_clusters=6, max_history_length=12, context_table_sizes=[30, 7], num_dense_features=3)


def _equal(a, b) -> bool:
    return (
        a.sparse.keys() == b.sparse.keys()
        and torch.equal(a.dense, b.dense)
        and torch.equal(a.labels, b.labels)
        and torch.equal(a.sparse.values(), b.sparse.values())
        and torch.equal(a.sparse.lengths(), b.sparse.lengths())
    )


def test_same_seed_same_batches_other_index_split_or_seed_other_batches():
    config = SyntheticSequenceConfig(**SMALL, global_batch_size=32, seed=3)
    a, b = SyntheticSequenceLog(config), SyntheticSequenceLog(config)
    assert _equal(a.global_batch("train", 2), b.global_batch("train", 2))
    assert not _equal(a.global_batch("train", 2), a.global_batch("train", 3))
    assert not _equal(a.global_batch("train", 2), a.global_batch("test", 2))
    other = SyntheticSequenceLog(SyntheticSequenceConfig(**SMALL, global_batch_size=32, seed=4))
    assert not _equal(a.global_batch("train", 2), other.global_batch("train", 2))


def test_rank_slices_partition_the_global_batch_and_follow_the_contract():
    config = SyntheticSequenceConfig(**SMALL, global_batch_size=32)
    log = SyntheticSequenceLog(config)
    full = log.global_batch("val", 0)
    assert full.sparse.keys() == ["history_item_id", "history_action", "candidate_item_id", "context_0", "context_1"]
    slices = [next(iter(SyntheticClickLogDataset(log, "val", 1, rank, 4))) for rank in range(4)]
    assert [s.batch_size for s in slices] == [8] * 4
    assert torch.equal(torch.cat([s.labels for s in slices]), full.labels)
    assert torch.equal(torch.cat([s.dense for s in slices]), full.dense)
    for key in full.sparse.keys():
        assert torch.equal(torch.cat([s.sparse[key].values() for s in slices]), full.sparse[key].values())
        assert torch.equal(torch.cat([s.sparse[key].lengths() for s in slices]), full.sparse[key].lengths())
    assert _equal(slice_batch(full, 8, 16), slices[1])
    assert torch.equal(full.sparse["history_item_id"].lengths(), full.sparse["history_action"].lengths())
    for key in ("candidate_item_id", "context_0", "context_1"):
        assert full.sparse[key].lengths().tolist() == [1] * 32
    assert full.dense.shape == (32, 3) and full.dense.dtype == torch.float32 and set(full.labels.unique().tolist()) <= {0.0, 1.0}


def test_datamodule_describes_its_batches_and_slices_by_rank():
    dm = SyntheticSequenceDataModule(**SMALL, global_batch_size=16, train_batches=2, val_batches=1)
    assert (dm.item_table_size, dm.num_action_types, dm.num_dense_features, dm.max_history_length) == (240, 3, 3, 12)
    assert dm.context_feature_names == ["context_0", "context_1"] and dm.context_table_sizes == [30, 7]
    batches = list(dm.train_dataloader())
    assert len(batches) == 2 and all(b.batch_size == 16 for b in batches)
    assert _equal(batches[1], dm.log.global_batch("train", 1))
    assert len(list(dm.val_dataloader())) == 1 and len(list(dm.test_dataloader())) == 10


def test_without_history_the_examples_and_labels_are_the_same():
    full = SyntheticSequenceLog(SyntheticSequenceConfig(**SMALL, global_batch_size=32)).global_batch("train", 1)
    pooled = SyntheticSequenceLog(SyntheticSequenceConfig(**SMALL, global_batch_size=32, emit_history=False)).global_batch("train", 1)
    assert pooled.sparse.keys() == ["candidate_item_id", "context_0", "context_1"]
    assert torch.equal(pooled.labels, full.labels) and torch.equal(pooled.dense, full.dense)
    for key in pooled.sparse.keys():
        assert torch.equal(pooled.sparse[key].values(), full.sparse[key].values())


def test_ids_lengths_and_actions_are_in_range():
    config = SyntheticSequenceConfig(**{**SMALL, "max_history_length": 9}, min_history_length=2, num_action_types=4, global_batch_size=2048)
    batch = SyntheticSequenceLog(config).global_batch("train", 0)
    lengths = batch.sparse["history_item_id"].lengths()
    assert lengths.min() == 2 and lengths.max() == 9  # both ends of the range occur in 2048 draws
    for key, rows in (("history_item_id", 240), ("candidate_item_id", 240), ("context_0", 30), ("context_1", 7)):
        values = batch.sparse[key].values()
        assert values.min() >= 0 and values.max() < rows, key
    actions = batch.sparse["history_action"].values()
    assert set(actions.unique().tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize("key", ["history_item_id", "candidate_item_id"])
def test_zipf_exponent_makes_hot_ids(key):
    def top_share(exponent: float) -> float:
        config = SyntheticSequenceConfig(num_items=1000, num_clusters=4, zipf_exponent=exponent, global_batch_size=4096)
        ids = SyntheticSequenceLog(config).global_batch("train", 0).sparse[key].values()
        return (torch.bincount(ids, minlength=1000).sort(descending=True).values[:20].sum() / ids.numel()).item()

    # 20 of 1000 rows: 2% of the draws when uniform (a little more for the 20 most drawn of 4096 candidates).
    assert top_share(0.0) < 0.06
    assert top_share(1.2) > 0.4
    assert top_share(1.2) > top_share(0.8) + 0.1


def _padded(batch, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    items, actions = batch.sparse["history_item_id"], batch.sparse["history_action"]
    valid = torch.arange(width) < items.lengths()[:, None]
    return items.to_padded_dense(width, padding_value=0), actions.to_padded_dense(width, padding_value=0), valid


def _logistic_auc(train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor, test_y: torch.Tensor) -> float:
    """Fit an L2-regularized logistic regression on train, score AUC on test."""
    torch.manual_seed(0)
    weights = torch.zeros(train_x.shape[1], requires_grad=True)
    bias = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.LBFGS([weights, bias], max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(train_x @ weights + bias, train_y) + 1e-3 * weights.square().sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    with torch.no_grad():
        return binary_auroc(test_x @ weights + bias, test_y.long()).item()


def test_the_planted_signal_is_in_the_history_only():
    """With no context signal, every pooled view of an example is chance; the history's positive actions are not."""
    config = SyntheticSequenceConfig(**SMALL, context_signal=0.0, global_batch_size=16384, seed=2)
    log = SyntheticSequenceLog(config)
    train, test = log.global_batch("train", 0), log.global_batch("test", 0)
    k = config.num_clusters

    def features(batch) -> dict[str, torch.Tensor]:
        candidate = batch.sparse["candidate_item_id"].values()
        candidate_cluster = torch.nn.functional.one_hot(log.cluster_of_row[candidate], k).float()
        items, actions, valid = _padded(batch, config.max_history_length)
        clusters = torch.nn.functional.one_hot(log.cluster_of_row[items], k).float()

        def cluster_share(mask: torch.Tensor) -> torch.Tensor:
            counts = (clusters * mask[..., None]).sum(1)
            return counts / counts.sum(1, keepdim=True).clamp(min=1)

        context = [torch.nn.functional.one_hot(batch.sparse[n].values(), s).float() for n, s in zip(config.context_feature_names, config.context_table_sizes)]
        pooled = torch.cat([torch.nn.functional.one_hot(candidate, config.num_items).float(), *context, batch.dense], 1)
        # Candidate cluster x history cluster shares: all history items, then only the positive ones.
        seen = (candidate_cluster[:, :, None] * cluster_share(valid.float())[:, None, :]).flatten(1)
        acted = (candidate_cluster[:, :, None] * cluster_share((valid & (actions > 0)).float())[:, None, :]).flatten(1)
        return {"pooled": pooled, "history items without actions": seen, "history positives": acted}

    train_x, test_x = features(train), features(test)
    aucs = {name: _logistic_auc(train_x[name], train.labels, test_x[name], test.labels) for name in train_x}
    assert abs(aucs["pooled"] - 0.5) < 0.02, aucs
    assert aucs["history positives"] > 0.65, aucs
    # Items without their actions only hint at it (a cluster seen more often holds more of the positives).
    assert aucs["history positives"] > aucs["history items without actions"] + 0.1, aucs
    # The click rate is alike for every candidate cluster (within sampling noise, ~0.01 here).
    rates = torch.stack([test.labels[log.cluster_of_row[test.sparse["candidate_item_id"].values()] == c].mean() for c in range(k)])
    assert (rates.max() - rates.min()).item() < 0.04, rates


def test_planted_logit_is_the_one_the_labels_were_drawn_from():
    config = SyntheticSequenceConfig(**SMALL, global_batch_size=8192, seed=7)
    log = SyntheticSequenceLog(config)
    batch = log.global_batch("test", 1)
    logit = log.planted_logit(batch)
    # Mean click probability matches the click rate, and the planted logit ranks well (the ceiling of any model).
    assert abs(torch.sigmoid(logit).mean().item() - batch.labels.mean().item()) < 0.015
    assert binary_auroc(logit, batch.labels.long()).item() > 0.75


def test_context_signal_is_learnable_by_a_pooled_model():
    config = SyntheticSequenceConfig(**SMALL, history_signal=0.0, global_batch_size=8192, seed=1)
    log = SyntheticSequenceLog(config)
    batch = log.global_batch("val", 0)
    context = [batch.sparse[n].values() for n in config.context_feature_names]
    assert binary_auroc(log.context_logit(context, batch.dense), batch.labels.long()).item() > 0.65


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_items": 100, "num_clusters": 8}, "num_items=100 must be a multiple of num_clusters=8"),
        ({"max_history_length": 0}, "max_history_length=0 must be an integer >= 1"),
        ({"min_history_length": 5, "max_history_length": 3}, "max_history_length=3 must be an integer >= 5"),
        ({"num_action_types": 1}, "num_action_types=1 must be an integer >= 2"),
        ({"interests_per_user": 9}, "interests_per_user=9 must be <= num_clusters=8"),
        ({"positive_rate_outside": 1.5}, r"positive_rate_outside=1.5 must be a probability in \[0, 1\]"),
        ({"context_table_sizes": [10, 0]}, r"context_table_sizes=\[10, 0\] must all be integers >= 1"),
        ({"zipf_exponent": -1.0}, "zipf_exponent=-1.0 must be >= 0"),
        ({"global_batch_size": 0}, "global_batch_size=0 must be an integer >= 1"),
    ],
)
@pytest.mark.parametrize("constructor", [SyntheticSequenceConfig, SyntheticSequenceDataModule])
def test_bad_configs_name_the_argument_and_the_rule(kwargs, message, constructor):
    with pytest.raises(ValueError, match=message):
        constructor(**kwargs)
