"""Event times from a prepared directory to the encoder: read and checked, cut and shuffled with the items, padded in their slots."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from lightning_recsys.testing.oracle.pretrain import make_batch
from torch import nn

from lightning_recsys.contracts.names import ITEM_FEATURE
from lightning_recsys.data.batch import SequenceBatch
from lightning_recsys.data.parquet.contract import FileInfo, PreparedBy, PreparedDataError, PreparedMetadata, RowGroupInfo, write_metadata
from lightning_recsys.data.parquet.module import SequenceParquetDataModule
from lightning_recsys.data.parquet.prepare import PrepareConfig, prepare
from lightning_recsys.data.parquet.streams import UserSequenceBatch
from lightning_recsys.data.sequences import UserSequences, sequence_batch
from lightning_recsys.models import SequencePretrainer
from lightning_recsys.models.encoders import HSTUEncoder
from lightning_recsys.models.pretrainer_ops import oldest_first_padded

NUM_ITEMS = 30
MAX_LENGTH = 4
USER = 1_000_000  # a raw time is user * USER + position * STEP + jitter: each time names its user and position
STEP = 1_000


# --- a directory written by `prepare` ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[str, dict[int, tuple[list[int], list[int]]]]:
    """A prepared directory with times, and each user's ``(item rows, times)`` as its user files hold them."""
    root = tmp_path_factory.mktemp("timed")
    rng = np.random.default_rng(5)
    rows = []
    for user in range(1, 40):
        for position in range(int(rng.choice([1, 2, 3, 4, 6, 9]))):
            rows.append((user, int(rng.integers(0, NUM_ITEMS)), user * USER + position * STEP + int(rng.integers(0, STEP))))
    order = rng.permutation(len(rows))  # prepare orders each user's events by time, not by input order
    events = pa.table({name: pa.array([rows[i][k] for i in order], pa.int64()) for k, name in enumerate(["user_id", "item_id", "ts"])})
    pq.write_table(events, root / "events.parquet")
    metadata = prepare(PrepareConfig(
        inputs=(str(root / "events.parquet"),), output=str(root / "out"), time_column="ts", row_group_events=40, threads=1,
    ))
    assert metadata.has_timestamps
    users: dict[int, tuple[list[int], list[int]]] = {}
    for info in metadata.files:
        table = pq.read_table(root / "out" / info.path)
        for user, items, times in zip(*(table.column(c).to_pylist() for c in ("user_id", "item_rows", "timestamps"))):
            users[user] = (items, times)
    return str(root / "out"), users


def _examples(batch: SequenceBatch):
    """Each example's ``(input items, times, next items)``."""
    ends = np.cumsum(batch.sparse[ITEM_FEATURE].lengths().numpy())
    starts = ends - batch.sparse[ITEM_FEATURE].lengths().numpy()
    items, times, nexts = batch.sparse[ITEM_FEATURE].values(), batch.timestamps, batch.next_item_ids
    return [(items[a:b].tolist(), times[a:b].tolist(), nexts[a:b].tolist()) for a, b in zip(starts, ends)]


def test_shuffled_training_batches_carry_each_items_time_from_the_file(prepared):
    path, users = prepared
    module = SequenceParquetDataModule(path, max_length=MAX_LENGTH, num_negatives=3, global_batch_size=3, shuffle_buffer=6)
    assert module.has_timestamps
    stream = module.stream("train", 0, 1)
    stream.begin_epoch()
    batches = list(stream)
    examples = [e for b in batches for e in _examples(b)]
    assert len(batches) > 3 and all(b.timestamps.dtype == torch.int64 for b in batches)
    trained = set()
    for items, times, nexts in examples:
        user = times[0] // USER
        file_items, file_times = users[user]
        first = file_times.index(times[0])
        count = len(file_items) - 2 if len(file_items) >= 3 else len(file_items)  # the training part
        # The newest max_length items before the training target, each with its own time: cut and shuffled together.
        assert first == max(0, count - 1 - MAX_LENGTH) and len(items) == min(MAX_LENGTH, count - 1)
        assert times == file_times[first : first + len(items)]
        assert items == file_items[first : first + len(items)] and nexts == file_items[first + 1 : first + 1 + len(items)]
        trained.add(user)
    assert len(trained) == len(examples)  # one example per user


@pytest.mark.parametrize("view", ["val", "test", "predict"])
def test_evaluation_and_predict_batches_carry_the_files_times(prepared, view):
    path, users = prepared
    module = SequenceParquetDataModule(path, max_length=MAX_LENGTH, global_batch_size=5)
    checked = 0
    for batch in module.stream(view, 0, 1):
        assert isinstance(batch, UserSequenceBatch)
        for user, (items, times, _) in zip(batch.user_ids.tolist(), _examples(batch)):
            file_items, file_times = users[user]
            stop = {"val": len(file_items) - 2, "test": len(file_items) - 1, "predict": len(file_items)}[view]
            start = max(0, stop - MAX_LENGTH)
            assert (items, times) == (file_items[start:stop], file_times[start:stop])
            checked += 1
    assert checked == sum(1 for items, _ in users.values() if view == "predict" or len(items) >= 3)


def test_timestamps_false_reads_no_times(prepared):
    path, _ = prepared
    with_times = SequenceParquetDataModule(path, max_length=MAX_LENGTH, global_batch_size=5)
    without = SequenceParquetDataModule(path, max_length=MAX_LENGTH, global_batch_size=5, timestamps=False)
    assert not without.has_timestamps
    timed, untimed = list(with_times.stream("predict", 0, 1)), list(without.stream("predict", 0, 1))
    assert all(b.timestamps is None for b in untimed) and all(b.timestamps is not None for b in timed)
    assert all(torch.equal(a.sparse.values(), b.sparse.values()) for a, b in zip(timed, untimed))
    assert without.bytes_read < with_times.bytes_read  # the column stays unread
    with pytest.raises(ValueError, match="timestamps='yes' must be true"):
        SequenceParquetDataModule(path, timestamps="yes")  # type: ignore[arg-type]


def test_batches_move_and_pin_with_their_times():
    sequences = UserSequences(
        items=np.array([1, 2, 3, 4]), offsets=np.array([0, 4]), user_ids=np.array([9]), num_items=5, timestamps=np.array([10, 20, 20, 40]),
    )
    batch = sequence_batch(sequences, np.array([0]), np.array([4]), 2, negatives=None)
    assert batch.timestamps.tolist() == [20, 20]  # the input s[:3] cut to its newest 2, as the items
    user_batch = UserSequenceBatch.of(batch, np.array([9]))
    moved = user_batch.to("cpu")
    assert isinstance(moved, UserSequenceBatch) and moved.timestamps.tolist() == [20, 20] and moved.user_ids.tolist() == [9]
    assert sequence_batch(dataclasses.replace(sequences, timestamps=None), np.array([0]), np.array([4]), 2, negatives=None).timestamps is None
    with pytest.raises(ValueError, match="3 timestamps for 4 items"):
        dataclasses.replace(sequences, timestamps=np.array([1, 2, 3]))


# --- bad times in the user files ---------------------------------------------------------------------------------------
def _hand_written(directory, items: list[list[int]], times: list[list[int] | None]) -> None:
    """One file, one row group, users 1..N, with a timestamps column as given."""
    (directory / "users").mkdir(parents=True)
    table = pa.table({
        "user_id": pa.array(range(1, len(items) + 1), pa.int64()),
        "item_rows": pa.array(items, pa.list_(pa.int64())),
        "timestamps": pa.array(times, pa.list_(pa.int64())),
    })
    pq.write_table(table, directory / "users/part-00000.parquet")
    lengths = [len(i) for i in items]
    group = RowGroupInfo(len(items), sum(lengths), tuple(lengths.count(n) for n in (1, 2, 3)))
    write_metadata(directory, PreparedMetadata(
        num_items=NUM_ITEMS, oov_row=None, oov_items=0, oov_events=0, num_users=len(items), num_events=sum(lengths),
        users_with_one_event=lengths.count(1), num_action_types=0, user_id_type="int64", has_actions=False, has_timestamps=True,
        files=(FileInfo("users/part-00000.parquet", len(items), sum(lengths), (group,)),), prepared_by=PreparedBy(tool="test", package_version=""),
    ))


ITEMS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]


@pytest.mark.parametrize(
    ("times", "message"),
    [
        ([[1, 2, 3], [9, 9], [5, 6, 6, 7]], None),  # equal times are fine; a user may start before the previous one ended
        ([[1, 2, 3], [9, 9], [5, 6, 4, 7]], r"row group 0, row 2: timestamps decrease at event 2 \(6 then 4\)"),
        ([[1, 2, 3], [9], [5, 6, 6, 7]], r"row group 0, row 1: timestamps has 1 values \(-1: null\) but item_rows has 2"),
        ([[1, 2, 3], None, [5, 6, 6, 7]], r"row group 0, row 1: timestamps has -1 values"),
        ([[1, 2, 3], [9, None], [5, 6, 6, 7]], r"row group 0, row 1: timestamps holds a null"),
    ],
)
def test_bad_times_name_the_file_row_group_and_row(tmp_path, times, message):
    _hand_written(tmp_path, ITEMS, times)
    module = SequenceParquetDataModule(str(tmp_path), global_batch_size=3)
    if message is None:
        (batch,) = list(module.stream("predict", 0, 1))
        assert batch.timestamps.tolist() == [t for user in times for t in user]
        return
    with pytest.raises(PreparedDataError, match=r"part-00000\.parquet, " + message):
        list(module.stream("predict", 0, 1))
    # Not read, not checked.
    (batch,) = list(SequenceParquetDataModule(str(tmp_path), global_batch_size=3, timestamps=False).stream("predict", 0, 1))
    assert batch.timestamps is None


# --- the pretrainer passes them to its encoder -------------------------------------------------------------------------
class _Recording(nn.Module):
    """A causal encoder that records how it was called and returns its tokens."""

    causal = True

    def __init__(self, embedding_dim: int, max_length: int) -> None:
        super().__init__()
        self.embedding_dim, self.max_length, self.token_dim = embedding_dim, max_length, embedding_dim
        self.calls: list[tuple] = []

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        self.calls.append(args)
        return args[0]


SEQUENCES = [[3, 7, 7, 1], [5], [9, 2, 4, 6, 8, 10, 12], [11, 13]]  # one longer than max_length
TIMES = [[100, 200, 200, 900], [50], [1, 2, 3, 4, 5, 6, 7], [10, 5000]]


def _timed_batch() -> SequenceBatch:
    batch = make_batch(SEQUENCES)
    return dataclasses.replace(batch, timestamps=torch.tensor([t for ts in TIMES for t in ts]))


def test_the_pretrainer_passes_each_items_time_in_its_tokens_slot():
    model = SequencePretrainer(num_items=20, embedding_dim=8, max_length=MAX_LENGTH, encoder=_Recording)
    model(_timed_batch())
    tokens, valid, timestamps = model.encoder.calls[-1]
    assert timestamps.dtype == torch.int64
    # Slot 0: the oldest kept item; the newest max_length of a longer sequence; 0 on padding.
    assert timestamps.tolist() == [[100, 200, 200, 900], [50, 0, 0, 0], [4, 5, 6, 7], [10, 5000, 0, 0]]
    padded_items, _ = oldest_first_padded(torch.tensor([4, 1, 7, 2]), torch.tensor([i for s in SEQUENCES for i in s]), MAX_LENGTH)
    assert torch.equal(padded_items[valid], torch.tensor([i for s in SEQUENCES for i in s[-MAX_LENGTH:]]))
    # Without times the encoder is called as before: tokens and valid only, the padding unchanged.
    model(make_batch(SEQUENCES))
    assert len(model.encoder.calls[-1]) == 2
    assert torch.equal(model.encoder.calls[-1][0], tokens) and torch.equal(model.encoder.calls[-1][1], valid)
    with pytest.raises(ValueError, match=r"timestamps have shape \(13,\), but there must be one per input item \(14"):
        model(dataclasses.replace(_timed_batch(), timestamps=torch.arange(13)))


def test_hstu_reads_the_times_through_the_pretrainer():
    torch.manual_seed(0)
    model = SequencePretrainer(num_items=20, embedding_dim=8, max_length=MAX_LENGTH, encoder=HSTUEncoder).eval()
    with torch.no_grad():  # a time bias per bucket, so that the times change the outputs
        model.encoder.time_bias.normal_()
    timed, untimed = _timed_batch(), make_batch(SEQUENCES)
    looked_up = model.item_embeddings(timed.sparse)[ITEM_FEATURE]
    tokens, valid = oldest_first_padded(looked_up.lengths(), looked_up.values(), MAX_LENGTH)
    times, _ = oldest_first_padded(looked_up.lengths(), timed.timestamps, MAX_LENGTH)
    with_times, without = model(timed), model(untimed)
    torch.testing.assert_close(with_times, model.encoder(tokens, valid, times), rtol=0, atol=0)
    torch.testing.assert_close(without, model.encoder(tokens, valid), rtol=0, atol=0)  # as before: no times
    assert not torch.allclose(with_times[valid], without[valid])
    assert torch.isfinite(model.training_losses(dataclasses.replace(timed, sparse=timed.sparse))["loss"])
