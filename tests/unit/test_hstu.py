"""HSTUEncoder: equal to a plain reference of the paper's equations, causal, blind to padding, trained and warm-started."""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torchrec import KeyedJaggedTensor

from lightning_recsys.checkpoint import CheckpointMismatchError
from lightning_recsys.checkpoint.warm_start import load_weights_unsharded
from lightning_recsys.contracts.encoder import SequenceEncoder
from lightning_recsys.contracts.warm_start import WARM_START_PARTS_KEY, parts_record
from lightning_recsys.data import RecBatch
from lightning_recsys.models import SequencePretrainer, SequenceRanker
from lightning_recsys.models.encoders import ENCODERS, HSTUEncoder, SASRecEncoder
from lightning_recsys.testing.crafted_checkpoints import write_checkpoint
from lightning_recsys.testing.oracle.pretrain import make_batch

DIM, LENGTH, HEADS, ATTENTION, LINEAR = 8, 7, 2, 3, 2
POSITION_BUCKETS, TIME_BUCKETS = 6, 5


def encoder(seed: int = 0, **overrides: object) -> HSTUEncoder:
    torch.manual_seed(seed)
    arguments = dict(num_layers=2, num_heads=HEADS, attention_dim=ATTENTION, linear_dim=LINEAR, dropout=0.0,
                     num_position_buckets=POSITION_BUCKETS, num_time_buckets=TIME_BUCKETS)  # fmt: skip
    module = HSTUEncoder(DIM, LENGTH, **{**arguments, **overrides})  # type: ignore[arg-type]
    with torch.no_grad():  # the biases start at zero; random ones make the test see them
        module.position_bias.normal_()
        module.time_bias.normal_()
    return module.eval()


# ------------------------------------------------------------------ the reference, one number at a time
def _position_bucket(distance: int, buckets: int, max_distance: int) -> int:
    exact = max(1, buckets // 2)
    if distance < exact:
        return distance
    return min(buckets - 1, exact + int(math.log(distance / exact) / math.log(max(max_distance, exact + 1) / exact) * (buckets - exact)))


def _time_bucket(gap: int, buckets: int) -> int:
    return min(buckets - 1, int(math.floor(math.log2(1 + abs(gap)))))


def _layer_norm(x: torch.Tensor, norm: torch.nn.LayerNorm) -> torch.Tensor:
    mean = x.mean()
    variance = ((x - mean) ** 2).mean()
    return (x - mean) / torch.sqrt(variance + norm.eps) * norm.weight + norm.bias


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def reference(module: HSTUEncoder, tokens: torch.Tensor, valid: torch.Tensor, timestamps: torch.Tensor | None) -> torch.Tensor:
    """HSTU written out: per example, layer, position and head, with the module's parameters."""
    out = torch.zeros_like(tokens)
    for b in range(tokens.shape[0]):
        x = [tokens[b, i] if valid[b, i] else torch.zeros(DIM) for i in range(LENGTH)]
        for index, layer in enumerate(module.layers):
            projected = []
            for i in range(LENGTH):
                row = _silu(layer.uvqk.weight @ _layer_norm(x[i], layer.input_norm) + layer.uvqk.bias)
                u, v = row[: HEADS * LINEAR], row[HEADS * LINEAR : 2 * HEADS * LINEAR]
                q, k = row[2 * HEADS * LINEAR : 2 * HEADS * LINEAR + HEADS * ATTENTION], row[2 * HEADS * LINEAR + HEADS * ATTENTION :]
                projected.append((u, v.view(HEADS, LINEAR), q.view(HEADS, ATTENTION), k.view(HEADS, ATTENTION)))
            new = []
            for i in range(LENGTH):
                if not valid[b, i]:
                    new.append(torch.zeros(DIM))
                    continue
                heads = []
                for h in range(HEADS):
                    total = torch.zeros(LINEAR)
                    for j in range(i + 1):  # causal: j <= i
                        if not valid[b, j]:
                            continue
                        score = projected[i][2][h] @ projected[j][3][h]
                        score = score + module.position_bias[index, h, _position_bucket(i - j, POSITION_BUCKETS, LENGTH)]
                        if timestamps is not None:
                            gap = int(timestamps[b, i] - timestamps[b, j])
                            score = score + module.time_bias[index, h, _time_bucket(gap, TIME_BUCKETS)]
                        total = total + _silu(score) / LENGTH * projected[j][1][h]  # SiLU, normalised by n, not softmax
                    heads.append(total)
                gated = _layer_norm(torch.cat(heads), layer.output_norm) * projected[i][0]
                new.append(x[i] + layer.output.weight @ gated + layer.output.bias)
            x = new
        out[b] = torch.stack(x)
    return out


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randn(3, LENGTH, DIM, generator=generator)
    lengths = torch.tensor([LENGTH, 4, 1])
    valid = torch.arange(LENGTH)[None, :] < lengths[:, None]
    tokens = tokens * valid[..., None]
    # Seconds, oldest first: gaps from a second to weeks, so several time buckets are used.
    timestamps = torch.cumsum(torch.randint(0, 2_000_000, (3, LENGTH), generator=generator), dim=1)
    return tokens, valid, timestamps


@pytest.mark.parametrize("with_time", [False, True], ids=["positions", "positions+time"])
def test_equals_the_reference_written_from_the_equations(with_time):
    module = encoder()
    tokens, valid, timestamps = batch()
    times = timestamps if with_time else None
    with torch.no_grad():
        torch.testing.assert_close(module(tokens, valid, times), reference(module, tokens, valid, times), rtol=1e-5, atol=1e-5)
    if with_time:  # the time buckets matter: without the timestamps the outputs differ
        assert not torch.allclose(module(tokens, valid, timestamps), module(tokens, valid))


def test_it_is_a_registered_causal_sequence_encoder():
    module = encoder()
    assert ENCODERS["hstu"] is HSTUEncoder and isinstance(module, SequenceEncoder) and module.causal
    assert (module.embedding_dim, module.max_length, module.token_dim) == (DIM, LENGTH, DIM)
    with pytest.raises(ValueError, match=r"HSTUEncoder: num_layers=0 must be an integer >= 1"):
        HSTUEncoder(DIM, LENGTH, num_layers=0)
    with pytest.raises(ValueError, match=r"HSTUEncoder: num_heads=9 exceeds embedding_dim=8"):
        HSTUEncoder(DIM, LENGTH, num_heads=9)
    with pytest.raises(ValueError, match=r"HSTUEncoder: dropout=1.0 must be a probability"):
        HSTUEncoder(DIM, LENGTH, dropout=1.0)


def test_an_output_never_sees_later_tokens_or_their_times():
    module = encoder()
    tokens, valid, timestamps = batch()
    before = module(tokens, valid, timestamps)
    changed_tokens, changed_times = tokens.clone(), timestamps.clone()
    changed_tokens[0, 4:] = torch.randn(LENGTH - 4, DIM)
    changed_times[0, 4:] += 10_000_000
    after = module(changed_tokens, valid, changed_times)
    torch.testing.assert_close(after[0, :4], before[0, :4], rtol=0, atol=0)
    assert not torch.allclose(after[0, 4:], before[0, 4:])


def test_padding_changes_nothing_and_its_outputs_are_zeros():
    module = encoder()
    tokens, valid, timestamps = batch()
    expected = module(tokens, valid, timestamps)
    noisy_tokens, noisy_times = tokens.clone(), timestamps.clone()
    noisy_tokens[~valid] = 1e3 * torch.randn(int((~valid).sum()), DIM)
    noisy_times[~valid] = -5
    torch.testing.assert_close(module(noisy_tokens, valid, noisy_times), expected, rtol=0, atol=0)
    assert torch.equal(expected[~valid], torch.zeros(int((~valid).sum()), DIM))
    alone = module(tokens[1:2], valid[1:2], timestamps[1:2])  # an example's outputs do not depend on its batch
    torch.testing.assert_close(alone[0], expected[1], rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ inside the models
ITEMS = 30
HSTU = partial(HSTUEncoder, num_layers=2, num_heads=2, dropout=0.0)


def pretrainer(seed: int = 0, **overrides: object) -> SequencePretrainer:
    torch.manual_seed(seed)
    arguments = dict(num_items=ITEMS, num_action_types=3, embedding_dim=DIM, max_length=6, encoder=HSTU, dense_lr=1e-2)
    return SequencePretrainer(**{**arguments, **overrides})  # type: ignore[arg-type]


def test_the_pretrainer_trains_with_it():
    model = pretrainer()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = make_batch(
        [[1, 2, 3, 4, 5], [6, 7, 8], [1, 2, 3]], actions=[[0, 1, 2, 0, 1], [1, 1, 2], [2, 0, 1]],
        pool=[[20, 21, 22, 23], [24, 25, 26], [27, 28, 29]],  # negatives: the loss is a softmax against them
    )
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = model.training_losses(data)["loss"]
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0], losses
    assert model.hparams["encoder"]["class_path"] == "lightning_recsys.models.encoders.HSTUEncoder"


def test_a_pretraining_checkpoint_warm_starts_an_hstu_ranker_by_role(tmp_path: Path):
    source = pretrainer()
    host_state: dict = {}
    source.on_save_checkpoint(host_state)  # what a Trainer's checkpoint of it holds beside the weights
    assert host_state[WARM_START_PARTS_KEY]["encoder"]["kind"] == "lightning_recsys.models.encoders.HSTUEncoder"
    checkpoint = write_checkpoint(source, tmp_path / "pretrain.ckpt", host_state=host_state)  # type: ignore[arg-type]
    torch.manual_seed(3)
    ranker = SequenceRanker(item_table_size=ITEMS, num_action_types=0, embedding_dim=DIM, max_history=6, encoder=HSTU,
                            over_arch_layer_sizes=[8, 1])  # fmt: skip
    result = load_weights_unsharded(checkpoint, ranker, parts=dict(ranker.warm_start_parts()))
    shared = {k: v for k, v in source.state_dict().items() if k.startswith(("encoder.", "item_embeddings.embeddings.item."))}
    assert set(result.loaded) == set(shared)
    for key, value in shared.items():
        torch.testing.assert_close(ranker.state_dict()[key], value, rtol=0, atol=0, msg=key)
    # A SASRec checkpoint is another kind of encoder: the warm start says so before reading anything.
    sasrec = pretrainer(encoder=partial(SASRecEncoder, num_layers=2, num_heads=2))
    other = write_checkpoint(sasrec, tmp_path / "sasrec.ckpt", host_state={WARM_START_PARTS_KEY: parts_record(sasrec.warm_start_parts())})  # type: ignore[arg-type]
    with pytest.raises(CheckpointMismatchError, match=r"'encoder' part differs in kind: the checkpoint's is .*SASRecEncoder, "
                       r"the model's is lightning_recsys\.models\.encoders\.HSTUEncoder"):  # fmt: skip
        load_weights_unsharded(other, ranker, parts={"encoder": ranker.warm_start_parts()["encoder"]})


def test_the_ranker_reads_the_candidate_after_the_history_with_it():
    torch.manual_seed(0)
    ranker = SequenceRanker(item_table_size=ITEMS, num_action_types=0, embedding_dim=DIM, max_history=6, encoder=HSTU,
                            over_arch_layer_sizes=[8, 1])  # fmt: skip
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=["history_item_id", "candidate_item_id"], values=torch.tensor([1, 2, 3, 4, 5, 6, 7]), lengths=torch.tensor([3, 1, 0, 1, 1, 1])
    )
    data = RecBatch(torch.zeros(3, 0), sparse, torch.tensor([1.0, 0.0, 1.0]))
    loss = F.binary_cross_entropy_with_logits(ranker(data), data.labels)
    loss.backward()
    assert torch.isfinite(loss) and ranker.encoder.position_bias.grad is not None
