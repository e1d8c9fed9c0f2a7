import torch
from torchmetrics.functional.classification import binary_auroc

from lightning_recsys.data import SyntheticClickLog, SyntheticClickLogConfig, slice_batch
from lightning_recsys.data.synthetic.click_log import SyntheticClickLogDataset

CONFIG = SyntheticClickLogConfig(table_sizes=[100, 500], num_dense_features=3, global_batch_size=64, seed=5)


def _equal(a, b) -> bool:
    return (
        torch.equal(a.dense, b.dense)
        and torch.equal(a.labels, b.labels)
        and torch.equal(a.sparse.values(), b.sparse.values())
        and torch.equal(a.sparse.lengths(), b.sparse.lengths())
        and a.sparse.keys() == b.sparse.keys()
    )


def test_same_seed_same_batches_other_seed_other_batches():
    a, b = SyntheticClickLog(CONFIG), SyntheticClickLog(CONFIG)
    assert _equal(a.global_batch("train", 3), b.global_batch("train", 3))
    assert not _equal(a.global_batch("train", 3), a.global_batch("train", 4))
    assert not _equal(a.global_batch("train", 3), a.global_batch("val", 3))
    other = SyntheticClickLog(SyntheticClickLogConfig(table_sizes=[100, 500], num_dense_features=3, global_batch_size=64, seed=6))
    assert not _equal(a.global_batch("train", 3), other.global_batch("train", 3))


def test_rank_slices_partition_the_global_batch():
    log = SyntheticClickLog(CONFIG)
    world = 4
    slices = [next(iter(SyntheticClickLogDataset(log, "train", 1, rank, world))) for rank in range(world)]
    full = log.global_batch("train", 0)
    assert all(s.batch_size == 16 for s in slices)
    assert torch.equal(torch.cat([s.labels for s in slices]), full.labels)
    assert torch.equal(torch.cat([s.dense for s in slices]), full.dense)
    for f, key in enumerate(full.sparse.keys()):
        expected = full.sparse[key]
        assert torch.equal(torch.cat([s.sparse[key].values() for s in slices]), expected.values())
        assert torch.equal(torch.cat([s.sparse[key].lengths() for s in slices]), expected.lengths())
    assert _equal(slice_batch(full, 0, 64), full)


def test_slice_batch_keeps_each_ids_weight():
    """A weighted batch's slice lost its weights (an unweighted KJT came back)."""
    from torchrec import KeyedJaggedTensor

    from lightning_recsys.data import RecBatch

    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b"], values=torch.tensor([1, 2, 3, 4, 5, 6]), lengths=torch.tensor([1, 2, 0, 2, 1, 0]),
        weights=torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]),
    )
    batch = RecBatch(dense=torch.zeros(3, 1), sparse=sparse, labels=torch.zeros(3))
    part = slice_batch(batch, 1, 3)  # examples 1 and 2: a's ids [2, 3], b's ids [6]
    assert part.sparse["a"].values().tolist() == [2, 3] and part.sparse["b"].values().tolist() == [6]
    assert torch.equal(part.sparse.weights(), torch.tensor([0.2, 0.3, 0.6]))
    assert slice_batch(RecBatch(dense=batch.dense, sparse=sparse, labels=batch.labels), 0, 3).sparse.weights().numel() == 6


def test_ids_are_in_range_zipf_skewed_and_pooled():
    config = SyntheticClickLogConfig(table_sizes=[1000], pooling_factors=3.0, global_batch_size=4096, zipf_exponent=1.1)
    batch = SyntheticClickLog(config).global_batch("train", 0)
    ids = batch.sparse["sparse_0"].values()
    assert ids.min() >= 0 and ids.max() < 1000
    counts = torch.bincount(ids, minlength=1000).sort(descending=True).values
    assert counts[:10].sum() > 0.3 * ids.numel()  # uniform would give 1%
    assert abs(batch.sparse["sparse_0"].lengths().float().mean().item() - 3.0) < 0.1


def test_planted_signal_is_learnable_but_constant_is_chance():
    config = SyntheticClickLogConfig(table_sizes=[200, 200], num_dense_features=4, global_batch_size=8192, seed=1)
    log = SyntheticClickLog(config)
    batch = log.global_batch("val", 0)
    assert binary_auroc(torch.zeros(8192), batch.labels.long()).item() == 0.5
    # The dense part alone, through the generator's own weights, already ranks well above chance.
    dense_score = batch.dense @ log._dense_weights
    assert binary_auroc(dense_score, batch.labels.long()).item() > 0.6
    assert 0.1 < batch.labels.mean().item() < 0.5
