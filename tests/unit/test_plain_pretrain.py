"""benchmarks/_plain_pretrain.py: the plain-PyTorch reference computes SequencePretrainer's loss on the same batch and weights."""

import _plain_pretrain  # benchmarks/_plain_pretrain.py
import _pretrain_speed_workload  # benchmarks/_pretrain_speed_workload.py
import numpy as np
import pytest
import torch

ITEMS, DIM, LENGTH = 200, 8, 8


@pytest.fixture(scope="module")
def bench():
    return _plain_pretrain, _pretrain_speed_workload


def _pair(bench, **options):
    plain_module, workload_module = bench
    workload = workload_module.PretrainWorkload(
        global_batch=16, max_length=LENGTH, num_negatives=60, embedding_dim=DIM, num_heads=2, dropout=0.0, num_items=ITEMS,
        num_users=64, unique_batches=2,
    )
    model = workload_module.pretrainer(workload, embedding_device=None)
    plain = plain_module.PlainSASRec(ITEMS, DIM, LENGTH, workload.num_layers, workload.num_heads, dropout=0.0, **options)
    with torch.no_grad():
        plain.item_embeddings.weight.copy_(model.item_embeddings.embeddings["item"].weight)
    plain.encoder.load_state_dict(model.encoder.state_dict())  # the same parameter names: strict load
    batch = workload_module.pretrain_batches(workload, 0, 1, 1)[0]
    return model, plain, batch, plain_module.plain_batch(batch, LENGTH)


def test_the_batch_has_truncated_examples_and_accidental_hits(bench):
    _, _, batch, padded = _pair(bench)
    raw_lengths = batch.sparse["item_id"].lengths()
    assert int(raw_lengths.max()) == LENGTH  # some example was cut to its newest LENGTH items
    targets = padded.target_ids[padded.valid]
    assert bool((padded.negative_ids[None, :] == targets[:, None]).any())  # the mask is exercised
    assert int(padded.valid.sum()) == bench[1].tokens(batch)


@pytest.mark.parametrize("sparse", [True, False])
def test_plain_loss_and_gradients_equal_the_pretrainers(bench, sparse):
    model, plain, batch, padded = _pair(bench, sparse=sparse)
    expected = model.training_losses(batch)["loss"]
    got = plain.loss(padded)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    expected.backward()
    got.backward()
    for name, param in model.encoder.named_parameters():
        torch.testing.assert_close(plain.encoder.get_parameter(name).grad, param.grad, rtol=1e-5, atol=1e-6, msg=name)
    table_grad = plain.item_embeddings.weight.grad
    table_grad = table_grad.to_dense() if table_grad.is_sparse else table_grad
    torch.testing.assert_close(table_grad, model.item_embeddings.embeddings["item"].weight.grad, rtol=1e-5, atol=1e-6)


def test_one_different_weight_changes_the_loss(bench):
    model, plain, batch, padded = _pair(bench)
    row = int(padded.target_ids[padded.valid][0])
    with torch.no_grad():
        plain.item_embeddings.weight[row, 0] += 0.1
    assert not torch.allclose(plain.loss(padded), model.training_losses(batch)["loss"], rtol=1e-6, atol=1e-6)


def test_plain_optimizers_step_the_sparse_table_and_the_dense_part(bench):
    plain_module, _ = bench
    _, plain, _, padded = _pair(bench)
    optimizers = plain_module.plain_optimizers(plain, "adagrad", table_lr=0.05, dense_lr=1e-3)
    before = plain.item_embeddings.weight.detach().clone(), plain.encoder.positions.detach().clone()
    plain.loss(padded).backward()
    for optimizer in optimizers:
        optimizer.step()
    touched = torch.unique(torch.cat([padded.item_ids[padded.valid], padded.target_ids[padded.valid], padded.negative_ids]))
    changed = (plain.item_embeddings.weight != before[0]).any(dim=1)
    assert set(torch.nonzero(changed).flatten().tolist()) <= set(touched.tolist()) and bool(changed.any())
    assert not torch.equal(plain.encoder.positions, before[1])
    with pytest.raises(ValueError, match="table_optimizer='adam'"):
        plain_module.plain_optimizers(plain, "adam", table_lr=0.05, dense_lr=1e-3)


def test_beauty_like_lengths_follow_beautys_counts(bench):
    lengths = bench[1].beauty_like_lengths(40_226, np.random.default_rng(0))
    assert lengths.min() == 5 and lengths.max() <= 293
    assert 8.0 < lengths.mean() < 9.6  # Beauty: 8.8 items per user
    assert np.percentile(lengths, 50) == 6  # Beauty's median


def test_the_profiler_breakdown_attributes_forward_and_backward_to_the_labels(bench):
    plain_module, workload_module = bench
    _, plain, _, padded = _pair(bench)
    optimizers = plain_module.plain_optimizers(plain, "adagrad", table_lr=0.05, dense_lr=1e-3)
    window = workload_module.ProfileWindow(start=1, steps=2)
    for index in range(4):
        window(index)
        for optimizer in optimizers:
            optimizer.zero_grad()
        plain.loss(padded).backward()
        for optimizer in optimizers:
            optimizer.step()
    rows = window.result
    assert rows is not None and window.profiler is None
    named = {row.split(" ")[0]: value for row, value in rows.items()}
    assert named["lookup"] > 0 and named["encoder"] > 0 and named["loss"] > 0 and named["optimizer"] > 0
    assert named["all-to-all"] == 0 and named["dense"] == 0
    # Every labelled row plus "other" adds up to the step's wall time.
    assert abs(sum(v for r, v in rows.items() if r != "step (wall)") - rows["step (wall)"]) < 1e-6


def test_the_encoder_row_counts_the_backward_of_its_ops(bench):
    """The encoder row holds its forward ranges and the backward of their ops (every LayerNorm backward among them)."""
    plain_module, workload_module = bench
    _, plain, _, padded = _pair(bench)
    with torch.profiler.profile() as profiler:
        plain.loss(padded).backward()
    events = profiler.events()
    forward_only = sum(e.cpu_time_total for e in events if e.name == plain_module.ENCODER) / 1e3
    rows = workload_module.step_breakdown(events, steps=1, wall_s=10.0)
    encoder = next(v for r, v in rows.items() if r.startswith("encoder"))
    backward = [e for e in events if e.name.startswith("autograd::engine::evaluate_function: NativeLayerNormBackward")]
    assert backward and encoder - forward_only >= sum(e.cpu_time_total for e in backward) / 1e3 * 0.999  # every LayerNorm is the encoder's
