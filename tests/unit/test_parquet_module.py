"""SequenceParquetDataModule: the text path's examples, ranks that tile the users, bounded reads, deterministic order."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from lightning_recsys.contracts.names import ACTION_FEATURE, ITEM_FEATURE, NEGATIVE_FEATURE, NEXT_ITEM_FEATURE
from lightning_recsys.data.parquet import reader as reader_module
from lightning_recsys.data.parquet.contract import (
    USER_FILE_WRITE_OPTIONS,
    FileInfo,
    PreparedBy,
    PreparedMetadata,
    RowGroupInfo,
    write_metadata,
)
from lightning_recsys.data.parquet.module import SequenceParquetDataModule
from lightning_recsys.data.parquet.reader import plan_rank
from lightning_recsys.data.parquet.streams import EpochLoader, UserSequenceBatch
from lightning_recsys.data.parquet.writing import PreparedWriter
from lightning_recsys.data.sequences import SequenceFileDataModule

NUM_ITEMS = 60


def _sequences(num_users: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.choice([1, 2, 3, 4, 5, 9, 14, 30], size=num_users)
    return [rng.integers(0, NUM_ITEMS, size=n) for n in lengths]


def _hand_written(directory, sequences: list[np.ndarray], group_rows: list[int], *, actions: list[np.ndarray] | None = None,
                  num_action_types: int = 0) -> None:
    """The contract written with pyarrow alone: one file per two row groups, user ids 1..N, item rows as given."""
    files, start, file_groups, groups = [], 0, [], []
    for size in group_rows:
        groups.append((start, start + size))
        start += size
    for index in range(0, len(groups), 2):
        file_groups.append(groups[index : index + 2])
    (directory / "users").mkdir(parents=True)
    for number, pairs in enumerate(file_groups):
        path = f"users/part-{number:05d}.parquet"
        writer, infos = None, []
        for lo, hi in pairs:
            columns = {
                "user_id": pa.array(np.arange(lo + 1, hi + 1), pa.int64()),
                "item_rows": pa.array([s.tolist() for s in sequences[lo:hi]], pa.list_(pa.int64())),
            }
            if actions is not None:
                columns["actions"] = pa.array([a.tolist() for a in actions[lo:hi]], pa.list_(pa.int32()))
            table = pa.table(columns)
            writer = writer or pq.ParquetWriter(directory / path, table.schema)
            writer.write_table(table, row_group_size=hi - lo)
            lengths = np.array([len(s) for s in sequences[lo:hi]])
            infos.append(RowGroupInfo(hi - lo, int(lengths.sum()), tuple(int((lengths == n).sum()) for n in (1, 2, 3))))
        writer.close()
        files.append(FileInfo(path, sum(i.num_rows for i in infos), sum(i.num_events for i in infos), tuple(infos)))
    write_metadata(directory, PreparedMetadata(
        num_items=NUM_ITEMS, oov_row=None, oov_items=0, oov_events=0, num_users=len(sequences),
        num_events=sum(len(s) for s in sequences), users_with_one_event=sum(len(s) == 1 for s in sequences),
        num_action_types=num_action_types, user_id_type="int64", has_actions=actions is not None, has_timestamps=False,
        files=tuple(files), prepared_by=PreparedBy(tool="test", package_version=""),
    ))


def _text_file(path, sequences: list[np.ndarray], actions: list[np.ndarray] | None = None) -> None:
    lines = []
    for user, items in enumerate(sequences, start=1):
        for position, item in enumerate(items):
            extra = f" {actions[user - 1][position]}" if actions is not None else ""
            lines.append(f"{user} {item + 1}{extra}")
    path.write_text("\n".join(lines) + "\n")


def _features(batches) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each KJT feature's values and lengths over all batches, and the seen ids."""
    out: dict[str, list] = {}
    for batch in batches:
        for key in batch.sparse.keys():
            out.setdefault(key, []).append((batch.sparse[key].values(), batch.sparse[key].lengths()))
        out.setdefault("seen", []).append((batch.seen_ids, batch.seen_lengths))
        out.setdefault("next", []).append((batch.next_item_ids, batch.seen_lengths[:0]))
    return {k: (torch.cat([v for v, _ in parts]), torch.cat([n for _, n in parts])) for k, parts in out.items()}


@pytest.fixture(scope="module")
def same_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("same")
    sequences = _sequences(41, seed=3)
    rng = np.random.default_rng(4)
    actions = [rng.integers(0, 3, size=len(s)) for s in sequences]
    _hand_written(root / "prepared", sequences, [10, 7, 13, 11], actions=actions, num_action_types=3)
    _text_file(root / "events.txt", sequences, actions)
    return root, sequences


@pytest.mark.parametrize("split", ["val", "test"])
def test_evaluation_examples_equal_the_text_paths(same_data, split):
    root, _ = same_data
    text = SequenceFileDataModule(str(root / "events.txt"), max_length=6, global_batch_size=8, shuffle=False, num_items=NUM_ITEMS,
                                  num_action_types=3)
    parquet = SequenceParquetDataModule(str(root / "prepared"), max_length=6, global_batch_size=8, shuffle=False)
    expected = _features(list(text._dataset(split, 0, 1)))
    actual = _features(list(parquet.stream(split, 0, 1)))
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key][0], actual[key][0]), key
        assert torch.equal(expected[key][1], actual[key][1]), key


def test_unshuffled_training_batches_equal_the_text_paths_but_for_the_negatives_drawn(same_data):
    root, _ = same_data
    text = SequenceFileDataModule(str(root / "events.txt"), max_length=4, num_negatives=5, global_batch_size=4, shuffle=False,
                                  num_items=NUM_ITEMS, num_action_types=3)
    parquet = SequenceParquetDataModule(str(root / "prepared"), max_length=4, num_negatives=5, global_batch_size=4, shuffle=False)
    expected, stream = list(text._dataset("train", 0, 1)), parquet.stream("train", 0, 1)
    stream.begin_epoch()
    actual = list(stream)
    assert len(actual) == len(expected) == len(stream) > 3
    for mine, theirs in zip(actual, expected):
        for key in (ITEM_FEATURE, NEXT_ITEM_FEATURE, ACTION_FEATURE):
            assert torch.equal(mine.sparse[key].values(), theirs.sparse[key].values()), key
            assert torch.equal(mine.sparse[key].lengths(), theirs.sparse[key].lengths()), key
        assert torch.equal(mine.sparse[NEGATIVE_FEATURE].lengths(), theirs.sparse[NEGATIVE_FEATURE].lengths())
        assert len(mine.sparse[NEGATIVE_FEATURE].values()) == 5


def test_the_metadata_alone_gives_the_sizes(same_data):
    root, sequences = same_data
    parquet = SequenceParquetDataModule(str(root / "prepared"))
    assert (parquet.num_items, parquet.num_action_types, parquet.num_users) == (NUM_ITEMS, 3, len(sequences))
    assert parquet.bytes_read == 0


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    directory = tmp_path_factory.mktemp("written")
    rng = np.random.default_rng(0)
    writer = PreparedWriter(directory, NUM_ITEMS, groups_per_file=3)
    first = 0
    for size in [23, 9, 31, 17, 26, 12, 20]:
        lengths = rng.choice([1, 2, 3, 4, 8, 20, 60], size=size)
        writer.write_group(np.arange(first, first + size) * 7, lengths, rng.integers(0, NUM_ITEMS, size=int(lengths.sum())))
        first += size
    writer.close()
    return directory, first


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("view", ["val", "test", "predict"])
def test_every_user_is_evaluated_once_over_the_ranks_in_the_same_number_of_non_empty_batches(written, world_size, view):
    directory, num_users = written
    module = SequenceParquetDataModule(str(directory), global_batch_size=4 * world_size)
    lengths = {}
    seen: list = []
    for rank in range(world_size):
        batches = list(module.stream(view, rank, world_size))
        assert all(isinstance(b, UserSequenceBatch) and b.batch_size > 0 for b in batches)
        lengths[rank] = len(batches)
        seen.extend(u for b in batches for u in b.user_ids.tolist())
    assert len(set(lengths.values())) == 1, lengths
    meta = module.metadata
    users = np.arange(num_users) * 7
    if view != "predict":  # users with >= 3 events
        event_counts = _user_lengths(directory, meta)
        users = users[event_counts >= 3]
    assert sorted(seen) == users.tolist()


def _user_lengths(directory, meta) -> np.ndarray:
    return np.concatenate([
        pq.read_table(directory / f.path, columns=["item_rows"]).column(0).combine_chunks().value_lengths().to_numpy() for f in meta.files
    ])


def test_rank_plans_tile_the_users_in_order(written):
    directory, num_users = written
    meta = SequenceParquetDataModule(str(directory)).metadata
    for world_size in (1, 2, 3, 7):
        covered = []
        for rank in range(world_size):
            covered.extend(range(s.first_user + s.start, s.first_user + s.stop) for s in plan_rank(meta, rank, world_size))
        assert [u for r in covered for u in r] == list(range(num_users))


def test_training_batches_are_full_equal_in_number_on_every_rank_and_deterministic(written):
    directory, _ = written
    module = SequenceParquetDataModule(str(directory), max_length=5, num_negatives=3, global_batch_size=6, shuffle_buffer=5)

    def epoch_of(rank: int, epoch: int, seed: int = 0):
        module.seed = seed
        stream = module.stream("train", rank, 2)
        stream.epoch = epoch
        stream.begin_epoch()
        return list(stream)

    counts = {rank: len(epoch_of(rank, 0)) for rank in range(2)}
    assert counts[0] == counts[1] == module.training_batches(2) > 2
    assert all(b.batch_size == 3 for b in epoch_of(1, 0))
    again, other_epoch, other_seed = epoch_of(0, 0), epoch_of(0, 1), epoch_of(0, 0, seed=1)
    first = epoch_of(0, 0)
    assert all(torch.equal(a.sparse.values(), b.sparse.values()) for a, b in zip(first, again))
    assert not torch.equal(first[0].sparse.values(), other_epoch[0].sparse.values())
    assert not torch.equal(first[0].sparse.values(), other_seed[0].sparse.values())


def _values(batches) -> list[torch.Tensor]:
    return [torch.cat([b.sparse.values(), b.sparse.lengths()]) for b in batches]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_epoch_yields_the_uninterrupted_epochs_remaining_batches(written, workers):
    directory, _ = written
    module = SequenceParquetDataModule(str(directory), max_length=5, num_negatives=3, global_batch_size=4, num_workers=workers,
                                       shuffle_buffer=4)
    loader = EpochLoader(module.stream("train", 1, 2), batch_size=None, num_workers=workers)
    full = _values(loader)
    assert len(full) == len(loader.dataset) > 4
    resumed = EpochLoader(module.stream("train", 1, 2), batch_size=None, num_workers=workers)
    resumed.dataset.skip = 3
    assert [torch.equal(a, b) for a, b in zip(_values(resumed), full[3:])] == [True] * (len(full) - 3)


def test_workers_give_the_same_batches_every_run_and_every_user_once_in_evaluation(written):
    directory, num_users = written
    module = SequenceParquetDataModule(str(directory), global_batch_size=4, num_workers=2)
    runs = [_values(EpochLoader(module.stream("train", 0, 2), batch_size=None, num_workers=2)) for _ in range(2)]
    assert len(runs[0]) == module.training_batches(2) and all(torch.equal(a, b) for a, b in zip(*runs))
    users = []
    for rank in range(2):
        loader = EpochLoader(module.stream("predict", rank, 2), batch_size=None, num_workers=2)
        batches = list(loader)
        assert len(batches) == len(loader.dataset)
        users.extend(u for b in batches for u in b.user_ids.tolist())
    assert sorted(users) == (np.arange(num_users) * 7).tolist()


def test_each_rank_reads_its_share_of_the_bytes_plus_one_row_group_and_its_footers(tmp_path):
    rng = np.random.default_rng(1)
    writer = PreparedWriter(tmp_path, 50_000, groups_per_file=2)
    for group in range(8):
        lengths = rng.integers(5, 60, size=5000)
        writer.write_group(np.arange(5000) + 5000 * group, lengths, rng.integers(0, 50_000, size=int(lengths.sum())))
    meta = writer.close()
    total = sum((tmp_path / f.path).stat().st_size for f in meta.files)
    footers = [pq.ParquetFile(tmp_path / f.path).metadata for f in meta.files]
    largest = max(sum(g.row_group(i).column(c).total_compressed_size for c in range(g.num_columns)) for g in footers for i in range(g.num_row_groups))
    # per column (2) past a head segment's last row: the rest of its page and the stream buffer
    read_ahead = 2 * (USER_FILE_WRITE_OPTIONS["data_page_size"] + reader_module._STREAM_BUFFER_BYTES)
    assert largest > 4 * read_ahead
    for world_size in (3, 4):
        for rank in range(world_size):
            module = SequenceParquetDataModule(str(tmp_path), global_batch_size=512 * world_size, shuffle_buffer=0)
            stream = module.stream("train", rank, world_size)
            stream.begin_epoch()
            list(stream)
            files = {s.file_index for s in plan_rank(meta, rank, world_size)}
            footer_bytes = sum(footers[f].serialized_size + 8 for f in files)
            bound = total / world_size + largest + read_ahead + footer_bytes
            assert total / world_size / 2 < module.bytes_read <= bound, (world_size, rank, module.bytes_read, bound)


def test_full_view_inputs_are_the_whole_history(written):
    directory, _ = written
    module = SequenceParquetDataModule(str(directory), max_length=100, global_batch_size=1000)
    (batch,) = list(module.stream("predict", 0, 1))
    meta = module.metadata
    lengths = _user_lengths(directory, meta)
    assert batch.sparse[ITEM_FEATURE].lengths().tolist() == lengths.tolist()
    assert batch.seen_lengths.tolist() == lengths.tolist()
    table = pq.read_table(directory / meta.files[0].path)
    assert batch.sparse[ITEM_FEATURE].values()[: lengths[0]].tolist() == table.column("item_rows")[0].as_py()


@pytest.mark.parametrize(
    ("argument", "value"),
    [("max_length", 0), ("num_negatives", -1), ("global_batch_size", 0), ("shuffle", "yes"), ("shuffle_buffer", -1),
     ("num_workers", -2), ("predict_view", "val"), ("seed", -1)],
)
def test_bad_arguments_name_the_argument(argument, value):
    with pytest.raises(ValueError, match=f"{argument}="):
        SequenceParquetDataModule("somewhere", **{argument: value})


def test_the_embedding_writer_streams_one_shard_per_rank_and_names_what_it_needs(written, tmp_path):
    from types import SimpleNamespace

    from lightning_recsys.data.parquet.embedding_writer import UserEmbeddingWriter

    directory, num_users = written
    module = SequenceParquetDataModule(str(directory), global_batch_size=16)
    writer = UserEmbeddingWriter(str(tmp_path / "out"), rows_per_group=10)
    trainer = SimpleNamespace(global_rank=1, world_size=2, datamodule=module)
    writer.on_predict_epoch_start(trainer, None)
    users = []
    for index, batch in enumerate(module.stream("predict", 1, 2)):
        rows = torch.arange(batch.batch_size * 2).reshape(-1, 2) % NUM_ITEMS
        prediction = {"user_vectors": torch.ones(batch.batch_size, 4), "top_k_ids": rows, "top_k_scores": rows.float()}
        writer.write_on_batch_end(trainer, None, prediction, None, batch, index, 0)
        users.extend(batch.user_ids.tolist())
    assert not (tmp_path / "out" / "embeddings-00001-of-00002.parquet").exists()  # only the .tmp until the loop ends
    writer.on_predict_epoch_end(trainer, None)
    table = pq.read_table(tmp_path / "out" / "embeddings-00001-of-00002.parquet")
    assert table.column("user_id").to_pylist() == users and writer.rows_written == len(users)
    assert table.column("top_k_item_ids").to_pylist() == table.column("top_k_rows").to_pylist()
    with pytest.raises(ValueError, match="names no users"):
        writer.write_on_batch_end(trainer, None, {"user_vectors": torch.ones(1, 4)}, None, object(), 0, 0)
    with pytest.raises(ValueError, match="rows_per_group=0 must be an integer >= 1"):
        UserEmbeddingWriter(str(tmp_path), rows_per_group=0)
