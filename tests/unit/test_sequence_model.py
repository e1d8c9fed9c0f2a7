"""SequenceRanker on one process: which history items it keeps, shapes, empty histories, meta tables, arguments."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torchrec import EmbeddingBagCollection, EmbeddingCollection, KeyedJaggedTensor

from lightning_recsys.data import RecBatch
from lightning_recsys.models import RankerModule, SequenceRanker
from lightning_recsys.models.sequence_ops import newest_padded

SEQUENCE_KEYS = ["history_item_id", "history_action", "candidate_item_id"]
SMALL = dict(
    item_table_size=30, num_action_types=3, context_feature_names=["user_id"], context_table_sizes=[7],
    num_dense_features=2, embedding_dim=8, max_history=4, newest_tokens=2, dropout=0.0, over_arch_layer_sizes=[16, 1],
)


def sequence_batch(histories: list[list[int]], actions: list[list[int]] | None = None, candidates: list[int] | None = None, seed: int = 0) -> RecBatch:
    """A batch of the contract's features; actions default to ``id % 3``, candidates to ``example``, users to ``example % 7``."""
    size = len(histories)
    actions = [[item % 3 for item in history] for history in histories] if actions is None else actions
    candidates = list(range(size)) if candidates is None else candidates
    columns = [histories, actions, [[c] for c in candidates], [[i % 7] for i in range(size)]]
    values = [v for column in columns for example in column for v in example]
    lengths = [len(example) for column in columns for example in column]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[*SEQUENCE_KEYS, "user_id"], values=torch.tensor(values, dtype=torch.long), lengths=torch.tensor(lengths)
    )
    generator = torch.Generator().manual_seed(seed)
    return RecBatch(torch.randn(size, 2, generator=generator), kjt, torch.randint(0, 2, (size,), generator=generator).float())


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: these tensors are tiny, and on a shared 2-core machine two threads spinning
    on each other made each small matmul ~100x slower (0.4 s per training step of the model below)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def small_model(**overrides: object) -> SequenceRanker:
    torch.manual_seed(0)
    return SequenceRanker(**{**SMALL, **overrides})  # type: ignore[arg-type]


def test_newest_padded_keeps_the_newest_items_newest_last_with_padding_before_them():
    histories = [[1, 2, 3], [], [4, 5, 6, 7, 8, 9], [10], [11, 12, 13, 14]]
    lengths = torch.tensor([len(h) for h in histories])
    values = torch.tensor([v for h in histories for v in h], dtype=torch.float32)[:, None].repeat(1, 2)
    padded, padding = newest_padded(lengths, values, 4)
    assert padded.shape == (5, 4, 2) and padding.shape == (5, 4) and padding.dtype == torch.bool
    # Example 2 keeps 6..9 (to_padded_dense would keep 4..7); shorter histories are right-aligned.
    expected = [[0, 1, 2, 3], [0, 0, 0, 0], [6, 7, 8, 9], [0, 0, 0, 10], [11, 12, 13, 14]]
    expected_padding = [[True, False, False, False], [True] * 4, [False] * 4, [True, True, True, False], [False] * 4]
    assert padded[..., 0].tolist() == expected and padded[..., 1].tolist() == expected
    assert padding.tolist() == expected_padding
    # Every example left out of the cut is gone: none of 4, 5 appears.
    assert not ({4.0, 5.0} & set(padded.flatten().tolist()))


def test_newest_padded_of_no_values_is_all_padding():
    padded, padding = newest_padded(torch.tensor([0, 0, 0]), torch.zeros(0, 3), 5)
    assert padded.shape == (3, 5, 3) and not padded.any() and padding.all()


def test_newest_padded_sends_gradients_only_to_the_kept_values():
    values = torch.ones(7, 2, requires_grad=True)
    padded, _ = newest_padded(torch.tensor([5, 2]), values, 3)
    padded.sum().backward()
    # Example 0 keeps its last 3 of 5 values (rows 2, 3, 4), example 1 both of its own (rows 5, 6).
    assert values.grad[:, 0].tolist() == [0, 0, 1, 1, 1, 1, 1]


def test_only_the_newest_max_history_items_and_their_actions_reach_the_logit():
    model = small_model().eval()
    base = [[1, 2, 3, 4, 5, 6], [7, 8]]
    logits = model(sequence_batch(base))
    # Items 1 and 2 (and their actions) are older than the newest 4: changing them changes nothing.
    older_changed = model(sequence_batch([[20, 21, 3, 4, 5, 6], [7, 8]], actions=[[2, 2, 0, 1, 2, 0], [1, 2]]))
    torch.testing.assert_close(older_changed, logits, rtol=0, atol=0)
    for histories, actions in (([[1, 2, 3, 4, 5, 20], [7, 8]], None), ([[1, 2, 3, 4, 5, 6], [7, 8]], [[1, 2, 0, 1, 2, 1], [1, 2]])):
        changed = model(sequence_batch(histories, actions))
        assert changed[0] != logits[0] and changed[1] == logits[1]


def test_forward_gives_one_finite_logit_per_example_and_builds_one_collection_per_kind():
    model = small_model()
    batch = sequence_batch([[1, 2, 3, 4, 5, 6], [7], [8, 9]])
    logits = model(batch)
    assert logits.shape == (3,) and logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert isinstance(model, RankerModule)
    (item, action) = model.sequence_embeddings.embedding_configs()
    assert (item.name, item.num_embeddings, item.feature_names) == ("item", 30, ["history_item_id", "candidate_item_id"])
    assert (action.name, action.num_embeddings, action.feature_names) == ("action", 3, ["history_action"])
    assert [(c.name, c.num_embeddings) for c in model.context_embeddings.embedding_bag_configs()] == [("t_user_id", 7)]
    # max-pool and 2 newest tokens (24 wide each), the candidate (8), one context table (8), 2 dense.
    assert model.over_arch[0].in_features == 3 * 24 + 8 + 8 + 2
    assert model.encoder.num_layers == 2 and model.encoder.layers[0].self_attn.num_heads == 2


def test_each_token_is_item_action_and_candidate_plus_its_slots_position_embedding():
    model = small_model().eval()
    seen: list[torch.Tensor] = []
    model.encoder.transformer.register_forward_pre_hook(lambda module, args, kwargs: seen.append(args[0]), with_kwargs=True)
    model(sequence_batch([[1, 2], [3]], actions=[[1, 2], [0]], candidates=[4, 5]))
    tables = model.sequence_embeddings.embeddings
    items, actions = tables["item"].weight.detach(), tables["action"].weight.detach()
    tokens = seen[0] - model.encoder.positions.detach()  # [B, max_history, 3 * 8], as TransActEncoder received them
    # Example 1's newest (last) slot: item 3, action 0, candidate 5; its earlier slots are padding with the candidate.
    torch.testing.assert_close(tokens[1, -1], torch.cat([items[3], actions[0], items[5]]))
    torch.testing.assert_close(tokens[0, -2], torch.cat([items[1], actions[1], items[4]]))
    torch.testing.assert_close(tokens[1, 0], torch.cat([torch.zeros(16), items[5]]))


def _over_arch_input(model: SequenceRanker, batch: RecBatch) -> torch.Tensor:
    seen: list[torch.Tensor] = []
    handle = model.over_arch.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    model.eval()(batch)
    handle.remove()
    return seen[0]


def test_action_means_are_the_mean_kept_item_embedding_of_each_action_type():
    model = small_model(action_means=True)
    assert model.over_arch[0].in_features == 3 * 24 + 8 + 3 * 8 + 8 + 2
    # Example 0 keeps its newest 4 (items 3, 4, 5, 6 with actions 0, 1, 1, 0); item 1 (action 2) is older.
    batch = sequence_batch([[1, 3, 4, 5, 6], [], [7]], actions=[[2, 0, 1, 1, 0], [], [2]])
    items = model.sequence_embeddings.embeddings["item"].weight.detach()
    means = _over_arch_input(model, batch)[:, 3 * 24 + 8 : 3 * 24 + 8 + 24].view(3, 3, 8)
    torch.testing.assert_close(means[0, 0], (items[3] + items[6]) / 2)
    torch.testing.assert_close(means[0, 1], (items[4] + items[5]) / 2)
    assert torch.equal(means[0, 2], torch.zeros(8))  # its only action-2 item is older than the newest 4
    assert torch.equal(means[1], torch.zeros(3, 8))  # an empty history
    torch.testing.assert_close(means[2, 2], items[7])


def test_dot_interaction_appends_the_pairwise_dots_of_candidate_history_context_and_dense():
    model = small_model(interaction="dot", action_means=True)
    vectors = 1 + 1 + 3 + 1 + 1  # candidate, projected history, 3 action means, user_id, projected dense
    assert model.over_arch[0].in_features == 3 * 24 + 8 + 3 * 8 + 8 + 2 + vectors * (vectors - 1) // 2
    batch = sequence_batch([[1, 2], [], [3, 4, 5]], actions=[[1, 1], [], [0, 2, 1]], candidates=[9, 10, 11])
    features = _over_arch_input(model, batch)
    items = model.sequence_embeddings.embeddings["item"].weight.detach()
    users = model.context_embeddings.embedding_bags["t_user_id"].weight.detach()
    pooled, means, dense = features[:, : 3 * 24], features[:, 3 * 24 + 8 : 3 * 24 + 32].view(3, 3, 8), batch.dense
    with torch.no_grad():
        stacked = torch.stack(
            [items[[9, 10, 11]], model.history_projection(pooled), *means.unbind(1), users[[0, 1, 2]], model.dense_projection(dense)], dim=1
        )
    gram = stacked @ stacked.transpose(1, 2)
    rows, cols = torch.triu_indices(vectors, vectors, offset=1)
    torch.testing.assert_close(features[:, -len(rows) :], gram[:, rows, cols])
    # The candidate x user dot (vectors 0 and 5) is there: example 2's is items[11] . users[2].
    pair = list(zip(rows.tolist(), cols.tolist())).index((0, 5))
    torch.testing.assert_close(features[2, -len(rows) + pair], items[11] @ users[2])
    plain = small_model(interaction="dot", num_dense_features=0)  # candidate, history, user_id: 3 dots
    assert plain.dense_projection is None and plain.over_arch[0].in_features == 3 * 24 + 8 + 8 + 3


def test_history_dropout_hides_whole_histories_in_training_only():
    model = small_model(history_dropout=0.5, action_means=True)  # SMALL has encoder dropout 0: only histories drop
    batch = sequence_batch([[1, 2, 3]] * 64, actions=[[1, 2, 1]] * 64, candidates=[4] * 64)
    empty = RecBatch(batch.dense, sequence_batch([[]] * 64, candidates=[4] * 64).sparse, batch.labels)
    with torch.no_grad():
        full, none = model.eval()(batch), model(empty)
        assert not torch.allclose(full, none)
        torch.manual_seed(1)
        dropped = model.train()(batch)
        assert torch.equal(model.eval()(batch), full)  # evaluation never drops
    # In training each example reads either its whole history or none, about half of each.
    as_full = torch.isclose(dropped, full, atol=1e-5)
    as_empty = torch.isclose(dropped, none, atol=1e-5)
    assert torch.all(as_full ^ as_empty)
    assert 16 < int(as_empty.sum()) < 48


def test_action_means_and_dot_interaction_train_with_empty_histories():
    model = small_model(interaction="dot", action_means=True).train()
    batch = sequence_batch([[], [3, 4], []])
    logits = model(batch)
    F.binary_cross_entropy_with_logits(logits, batch.labels).backward()
    assert torch.isfinite(logits).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert model.history_projection.weight.grad.abs().sum() > 0


def test_heads_feedforward_and_no_context_are_configurable():
    model = small_model(context_feature_names=None, context_table_sizes=None, num_dense_features=0,
                        num_heads=3, num_layers=1, feedforward_dim=20, newest_tokens=0)
    assert model.context_embeddings is None and model.encoder.layers[0].self_attn.num_heads == 3
    assert model.encoder.num_layers == 1 and model.encoder.layers[0].linear1.out_features == 20
    assert model.over_arch[0].in_features == 24 + 8  # the max-pool (3 * 8 wide) and the candidate
    batch = sequence_batch([[1, 2], [3]])
    batch = RecBatch(torch.zeros(2, 0), batch.sparse, batch.labels)
    assert model(batch).shape == (2,)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_empty_histories_give_finite_logits_and_gradients(train: bool):
    model = small_model().train(train)
    for histories in ([[], [], []], [[], [3, 4], []]):
        batch = sequence_batch(histories)
        with torch.set_grad_enabled(train):
            logits = model(batch)
        assert torch.isfinite(logits).all(), logits
        if train:
            model.zero_grad()
            F.binary_cross_entropy_with_logits(logits, batch.labels).backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            assert grads and all(torch.isfinite(g).all() for g in grads)


def test_an_empty_history_reads_the_same_whatever_its_padding_attends_to():
    # The one unmasked slot of an empty history is never pooled: its logit depends on the candidate, context and dense only.
    model = small_model().eval()
    alone = model(sequence_batch([[]], candidates=[5]))
    beside_others = model(sequence_batch([[], [1, 2, 3]], candidates=[5, 6]))
    torch.testing.assert_close(beside_others[0], alone[0])


def test_builds_tables_on_meta_and_dense_layers_on_cpu():
    model = SequenceRanker(item_table_size=10**8, num_action_types=5, context_feature_names=["u"], context_table_sizes=[10**8], embedding_device="meta")
    tables = [p for n, p in model.named_parameters() if "embeddings." in n]
    dense = [p for n, p in model.named_parameters() if "embeddings." not in n]
    assert len(tables) == 3 and all(p.is_meta for p in tables)
    assert dense and not any(p.is_meta for p in dense)


def test_a_hundred_steps_fit_a_small_batch():
    torch.manual_seed(1)
    model = small_model(dense_optimizer="adam", dense_lr=0.03)
    optimizer = model.configure_optimizers()
    histories = [[int(v) for v in torch.randint(0, 30, (int(n),))] for n in torch.randint(0, 7, (32,))]
    batch = sequence_batch(histories, candidates=torch.randint(0, 30, (32,)).tolist(), seed=1)
    losses = []
    for _ in range(100):
        loss = F.binary_cross_entropy_with_logits(model(batch), batch.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > 0.6 and losses[-1] < 0.01, (losses[0], losses[-1])


@pytest.mark.parametrize(
    ("histories", "actions", "candidates", "match"),
    [
        ([[1, 2], [3]], [[1], [1]], None, r"features 'history_item_id' and 'history_action' must have the same length in every "
         r"example \(SequenceRanker reads them position by position\), but example 0 has 2 and 1"),
        ([[1, 2], [3]], None, "two", r"feature 'candidate_item_id' must hold exactly one id per example \(SequenceRanker\), but "
         r"example 0 has 2"),
    ],
)
def test_misaligned_sequence_features_raise(histories, actions, candidates, match):
    batch = sequence_batch(histories, actions=actions)
    if candidates == "two":
        kjt = batch.sparse.to_dict()
        kjt["candidate_item_id"] = type(kjt["candidate_item_id"])(values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]))
        batch = RecBatch(batch.dense, KeyedJaggedTensor.from_jt_dict(kjt), batch.labels)
    with pytest.raises(ValueError, match=match):
        small_model()(batch)


_INVALID = [
    ({"item_table_size": 0}, r"item_table_size=0 must be an integer >= 1"),
    ({"num_action_types": 2.5}, r"num_action_types=2.5 must be an integer >= 1"),
    ({"num_dense_features": -1}, r"num_dense_features=-1 must be an integer >= 0"),
    ({"embedding_dim": 0}, r"embedding_dim=0 must be an integer >= 1"),
    ({"max_history": 0}, r"max_history=0 must be an integer >= 1"),
    ({"num_layers": 0}, r"num_layers=0 must be an integer >= 1"),
    ({"num_heads": True}, r"num_heads=True must be an integer >= 1"),
    ({"feedforward_dim": 0}, r"feedforward_dim=0 must be an integer >= 1"),
    ({"newest_tokens": 5}, r"newest_tokens=5 must be an integer in \[0, max_history=4\]"),
    ({"dropout": 1.0}, r"dropout=1.0 must be a probability in \[0, 1\)"),
    ({"num_heads": 5}, r"num_heads=5 must divide the token width \(3 \* embedding_dim=24\)"),
    ({"action_means": "yes"}, r"action_means='yes' must be True or False"),
    ({"interaction": "candidate_dots"}, r"interaction='candidate_dots' is not one of \['concat', 'dot'\]"),
    ({"history_dropout": 1.0}, r"history_dropout=1.0 must be a probability in \[0, 1\)"),
    ({"action_loss_weight": -1.0}, r"action_loss_weight=-1.0 must be a number >= 0"),
    ({"action_loss_weight": 1.0}, r"action_loss_weight=1.0 needs positive_actions"),
    ({"positive_actions": [3]}, r"positive_actions=\[3\] must be distinct action ids in \[0, num_action_types=3\)"),
    ({"positive_actions": [1, 1]}, r"positive_actions=\[1, 1\] must be distinct action ids"),
    ({"context_table_sizes": [7, 8]}, r"context_feature_names has 1 entries but context_table_sizes has 2"),
    ({"context_table_sizes": [0]}, r"context_table_sizes=\[0\] must all be integers >= 1"),
    ({"context_feature_names": ["history_action"]}, r"feature name\(s\) \['history_action'\] are used twice"),
    ({"candidate_item_feature": "history_item_id"}, r"feature name\(s\) \['history_item_id'\] are used twice"),
    ({"history_item_feature": ""}, r"feature names must be non-empty strings"),
    ({"over_arch_layer_sizes": [8, 2]}, r"over_arch_layer_sizes=\[8, 2\] must end in 1"),
    ({"over_arch_layer_sizes": []}, r"over_arch_layer_sizes=\[\] must be a non-empty list of integers >= 1"),
    ({"embedding_device": "nowhere"}, r"embedding_device='nowhere' is not a torch device"),
    ({"dense_optimizer": "lbfgs"}, r"dense_optimizer='lbfgs' is not one of"),
    ({"dense_lr": 0.0}, r"dense_lr=0.0 must be > 0"),
]


@pytest.mark.parametrize(("overrides", "match"), _INVALID, ids=[m.split("=")[0].split(" ")[0] for _, m in _INVALID])
def test_bad_arguments_raise_naming_the_argument_and_the_rule(overrides, match):
    with pytest.raises(ValueError, match=match):
        small_model(**overrides)


def test_defaults_are_near_transact_and_the_collections_are_torchrecs():
    model = SequenceRanker(item_table_size=100, num_action_types=5)
    assert model.max_history == 100 and model.newest_tokens == 10
    assert model.encoder.num_layers == 2 and model.encoder.layers[0].self_attn.num_heads == 2
    assert model.encoder.layers[0].self_attn.embed_dim == 3 * 32 and model.encoder.positions.shape == (100, 3 * 32)
    assert isinstance(model.sequence_embeddings, EmbeddingCollection) and model.context_embeddings is None
    assert not isinstance(model.sequence_embeddings, EmbeddingBagCollection)


def _guard_problems(batch: RecBatch) -> list[tuple[str, bool]]:
    from lightning_recsys.parallel.input import InputValidator, feature_tables, module_length_rules

    model = small_model()
    validator = InputValidator(feature_tables(model), module_length_rules(model))
    return [(p.message, p.fatal) for p in validator.check(batch.sparse, batch=3)]


def test_the_input_guard_sees_the_sequence_tables_and_names_an_out_of_range_history_id():
    assert _guard_problems(sequence_batch([[1, 2], [3]])) == []
    ((message, fatal),) = _guard_problems(sequence_batch([[1, 2], [3, 30]]))
    assert "feature 'history_item_id' has id 30 at example 1, but table 'item' has 30 rows (valid ids are 0..29)" in message
    assert not fatal  # FBGEMM would clamp it: 'warn' can let it through, as for pooled features
    ((message, _),) = _guard_problems(sequence_batch([[1, 2], [3]], actions=[[0, 1], [3]]))
    assert "feature 'history_action' has id 3 at example 1, but table 'action' has 3 rows" in message


def test_the_input_guard_checks_the_models_length_rules_as_fatal():
    ((message, fatal),) = _guard_problems(sequence_batch([[1, 2], [3, 4]], actions=[[0, 1], [2]]))
    assert message.startswith("batch 3: features 'history_item_id' and 'history_action' must have the same length") and fatal
    assert "example 1 has 2 and 1 (1 example(s) differ)" in message


def test_a_profile_of_sequence_batches_gives_the_shared_item_table_both_features():
    from lightning_recsys.planner.stats import profile_datamodule, resolve_table_stats
    from lightning_recsys.testing.oracle.sequence import SequenceDataModule, SequenceLogConfig, global_batch, make_model

    model = make_model()
    tables = [*model.sequence_embeddings.embedding_configs(), *model.context_embeddings.embedding_bag_configs()]
    stats, assumed = resolve_table_stats(tables, profile_datamodule(SequenceDataModule(), 3))
    assert not assumed
    histories = torch.cat([global_batch(SequenceLogConfig(), "train", i).sparse["history_item_id"].lengths() for i in range(3)])
    # The item table serves the history and the candidate (one id per example): 2 features, their mean ids.
    assert stats["item"].features == 2
    assert stats["item"].pooling_factor == pytest.approx((float(histories.float().mean()) + 1) / 2)
    assert stats["action"].features == 1 and stats["action"].pooling_factor == pytest.approx(float(histories.float().mean()))


def test_bf16_autocast_gives_finite_logits_close_to_fp32_with_empty_histories():
    # What Trainer(precision="bf16-mixed") runs on CPU: the padding masks and the -inf max-pool fill in bf16.
    model = small_model().eval()
    batch = sequence_batch([[], [1, 2, 3, 4, 5, 6], [7]])
    with torch.no_grad():
        reference = model(batch)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(batch)
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits.float(), reference, rtol=0, atol=2e-2)
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.binary_cross_entropy_with_logits(model(batch).float(), batch.labels)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
