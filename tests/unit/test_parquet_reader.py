"""The prepared-directory reader: each bad input is a PreparedDataError naming the file, row group and row."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lightning_recsys.data.parquet.contract import PreparedDataError
from lightning_recsys.data.parquet.module import SequenceParquetDataModule
from lightning_recsys.data.parquet import reader as reader_module
from lightning_recsys.data.parquet.reader import PreparedReader, open_prepared, plan_rank
from lightning_recsys.data.parquet.writing import PreparedWriter

NUM_ITEMS = 50
PART = "users/part-00000.parquet"


def _good(directory, *, num_action_types: int = 0) -> None:
    """Two files; the first with row groups of 4 and 5 users, the second with one of 3."""
    rng = np.random.default_rng(0)
    writer = PreparedWriter(directory, NUM_ITEMS, num_action_types=num_action_types, groups_per_file=2)
    first = 0
    for size in (4, 5, 3):
        lengths = rng.integers(3, 7, size=size)
        actions = rng.integers(0, max(1, num_action_types), size=int(lengths.sum())) if num_action_types else None
        writer.write_group(np.arange(first, first + size) + 100, lengths, rng.integers(0, NUM_ITEMS, size=int(lengths.sum())), actions)
        first += size
    writer.close()


def _replace_part(directory, groups: list[dict], schema: pa.Schema | None = None) -> None:
    """Rewrite users/part-00000.parquet with these row groups (columns as Python lists)."""
    path = directory / PART
    writer = None
    for columns in groups:
        table = pa.table(columns, schema=schema)
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table, row_group_size=table.num_rows)
    writer.close()


def _read_all(directory) -> None:
    meta = open_prepared(directory)
    reader = PreparedReader(directory, meta)
    for segment in plan_rank(meta, 0, 1):
        reader.read(segment)


def _rows(rows: list[list[int]], first_user: int = 100) -> dict:
    return {"user_id": pa.array(range(first_user, first_user + len(rows)), pa.int64()), "item_rows": pa.array(rows, pa.list_(pa.int64()))}


GOOD_SECOND_GROUP = [[1, 2, 3]] * 5


@pytest.fixture
def directory(tmp_path):
    _good(tmp_path)
    return tmp_path


def test_a_good_directory_reads(directory):
    _read_all(directory)


def test_an_empty_directory(tmp_path):
    with pytest.raises(PreparedDataError, match="the directory is empty"):
        open_prepared(tmp_path)


def test_a_file_that_is_not_parquet(directory):
    (directory / PART).write_bytes(b"user item\n1 2\n" * 100)
    with pytest.raises(PreparedDataError, match=r"part-00000\.parquet: not a readable parquet file"):
        _read_all(directory)


def test_a_truncated_file(directory):
    data = (directory / PART).read_bytes()
    (directory / PART).write_bytes(data[: len(data) // 2])
    with pytest.raises(PreparedDataError, match=r"part-00000\.parquet: not a readable parquet file \(not parquet, or truncated\)"):
        _read_all(directory)


def test_a_file_truncated_inside_a_row_group_with_its_footer_intact(directory):
    # The data of row group 0 zeroed: the footer reads, the row group does not decode.
    data = bytearray((directory / PART).read_bytes())
    data[4:60] = bytes(56)
    (directory / PART).write_bytes(bytes(data))
    with pytest.raises(PreparedDataError, match=r"part-00000\.parquet, row group 0: cannot be read"):
        _read_all(directory)


def test_a_missing_column(directory):
    _replace_part(directory, [{"user_id": pa.array(range(4), pa.int64())}, {"user_id": pa.array(range(4, 9), pa.int64())}])
    with pytest.raises(PreparedDataError, match=r"part-00000\.parquet: column 'item_rows' is missing"):
        _read_all(directory)


def test_a_list_column_of_the_wrong_type(directory):
    rows = [[1.5, 2.0, 3.0]] * 4
    _replace_part(directory, [
        {"user_id": pa.array(range(4), pa.int64()), "item_rows": pa.array(rows, pa.list_(pa.float64()))},
        {"user_id": pa.array(range(4, 9), pa.int64()), "item_rows": pa.array([[1.0, 2.0, 3.0]] * 5, pa.list_(pa.float64()))},
    ])
    with pytest.raises(PreparedDataError, match=r"column 'item_rows' is list<element: double>; it must be list<int32> or list<int64>"):
        _read_all(directory)


def test_string_user_ids_where_the_metadata_says_int64(directory):
    _replace_part(directory, [
        {"user_id": pa.array(["a", "b", "c", "d"]), "item_rows": pa.array([[1, 2, 3]] * 4, pa.list_(pa.int64()))},
        {"user_id": pa.array(list("efghi")), "item_rows": pa.array(GOOD_SECOND_GROUP, pa.list_(pa.int64()))},
    ])
    with pytest.raises(PreparedDataError, match="column 'user_id' is string, but metadata.json says user_id_type='int64'"):
        _read_all(directory)


@pytest.mark.parametrize(
    ("bad_row", "message"),
    [
        ([4, None, 6], r"row group 1, row 2: item_rows holds a null row"),
        ([4, -1, 6], r"row group 1, row 2: item row -1 is outside \[0, num_items=50\)"),
        ([4, 50, 6], r"row group 1, row 2: item row 50 is outside \[0, num_items=50\)"),
        (None, r"row group 1, row 2: item_rows is null"),
        ([], r"row group 1, row 2: item_rows is empty"),
    ],
)
def test_bad_item_rows_name_the_file_row_group_and_row(directory, bad_row, message):
    rows = [[1, 2, 3]] * 5
    rows[2] = bad_row
    _replace_part(directory, [_rows([[1, 2, 3]] * 4), _rows(rows, first_user=104)])
    # the first row group's event count no longer matches; only row group 1 is read here
    meta = open_prepared(directory)
    reader = PreparedReader(directory, meta)
    segment = [s for s in plan_rank(meta, 0, 1) if s.path == PART and s.row_group == 1][0]
    with pytest.raises(PreparedDataError, match=rf"part-00000\.parquet, {message}"):
        reader.read(segment)


def test_one_user_twice_in_a_row_group(directory):
    _replace_part(directory, [
        {"user_id": pa.array([7, 8, 7, 9], pa.int64()), "item_rows": pa.array([[1, 2, 3]] * 4, pa.list_(pa.int64()))},
        _rows(GOOD_SECOND_GROUP),
    ])
    meta = open_prepared(directory)
    with pytest.raises(PreparedDataError, match=r"row group 0, rows 0 and 2: user_id 7 appears twice"):
        PreparedReader(directory, meta).read(plan_rank(meta, 0, 1)[0])


def test_row_counts_that_disagree_with_the_metadata(directory):
    _replace_part(directory, [_rows([[1, 2, 3]] * 4), _rows([[1, 2, 3]] * 6)])
    with pytest.raises(PreparedDataError, match=r"part-00000\.parquet: metadata.json lists 2 row groups with 9 rows \(4, 5\) but the file has 2 with 10 \(4, 6\)"):
        _read_all(directory)


def test_events_that_disagree_with_the_metadata(directory):
    _replace_part(directory, [_rows([[1, 2, 3]] * 4), _rows(GOOD_SECOND_GROUP)])
    with pytest.raises(PreparedDataError, match=r"part-00000\.parquet, row group 0: holds 12 events but metadata.json says"):
        _read_all(directory)


def test_a_listed_file_that_is_missing(directory):
    (directory / "users/part-00001.parquet").unlink()
    with pytest.raises(PreparedDataError, match=r"part-00001\.parquet: listed in metadata.json \(files\[1\]\) but missing"):
        _read_all(directory)


def test_metadata_whose_sums_disagree(directory):
    data = json.loads((directory / "metadata.json").read_text())
    data["num_users"] += 1
    (directory / "metadata.json").write_text(json.dumps(data))
    with pytest.raises(PreparedDataError, match="num_users"):
        SequenceParquetDataModule(str(directory)).num_items


def test_actions_of_another_length_than_the_items(tmp_path):
    _good(tmp_path, num_action_types=2)
    table = pq.read_table(tmp_path / PART)
    actions = table.column("actions").to_pylist()
    actions[1] = actions[1][:-1]
    groups = [table.slice(0, 4), table.slice(4, 5)]
    fixed = []
    for index, group in enumerate(groups):
        columns = {name: group.column(name) for name in group.column_names}
        columns["actions"] = pa.array(actions[:4] if index == 0 else actions[4:], pa.list_(pa.int32()))
        fixed.append(columns)
    _replace_part(tmp_path, fixed)
    with pytest.raises(PreparedDataError, match=r"row group 0, row 1: actions has \d+ values \(-1: null\) but item_rows has \d+"):
        _read_all(tmp_path)


def test_bytes_are_counted(directory):
    meta = open_prepared(directory)
    reader = PreparedReader(directory, meta)
    assert reader.bytes_read == 0
    first, second = plan_rank(meta, 0, 1)[:2]
    reader.read(first)
    after_first = reader.bytes_read
    footer = pq.ParquetFile(directory / PART).metadata
    group_bytes = [
        sum(footer.row_group(g).column(c).total_compressed_size for c in range(footer.num_columns)) for g in range(2)
    ]
    # the footer exactly (its bytes, its length and the magic), then the row group's column chunks
    assert after_first == footer.serialized_size + 8 + group_bytes[0]
    reader.read(second)
    assert reader.bytes_read == after_first + group_bytes[1]  # the footer is read once per file


def test_a_head_segment_stops_reading_after_its_pages(tmp_path):
    rng = np.random.default_rng(3)
    writer = PreparedWriter(tmp_path, 50_000, groups_per_file=1)
    lengths = rng.integers(5, 60, size=20_000)
    writer.write_group(np.arange(20_000), lengths, rng.integers(0, 50_000, size=int(lengths.sum())))
    meta = writer.close()
    (whole,) = plan_rank(meta, 0, 1)
    group = pq.ParquetFile(tmp_path / whole.path).metadata.row_group(0)
    group_bytes = sum(group.column(c).total_compressed_size for c in range(group.num_columns))
    for start, stop in ((0, 2000), (5000, 6000)):
        reader = PreparedReader(tmp_path, meta)
        chunk = reader.read(dataclasses.replace(whole, start=start, stop=stop))
        assert chunk.sequences.user_ids.tolist() == list(range(start, stop))
        assert np.array_equal(np.diff(chunk.sequences.offsets), lengths[start:stop])
        assert reader.bytes_read < group_bytes * (stop / 20_000 + 0.15), (start, stop, reader.bytes_read, group_bytes)
    tail = PreparedReader(tmp_path, meta)
    tail.read(dataclasses.replace(whole, start=19_000))
    assert tail.bytes_read > group_bytes  # a tail needs the pages before it: the whole row group


def test_the_footers_kept_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(reader_module, "_MAX_CACHED_FOOTERS", 2)
    monkeypatch.setattr(reader_module, "_MAX_OPEN_FILES", 1)
    writer = PreparedWriter(tmp_path, NUM_ITEMS, groups_per_file=1)
    for group in range(3):
        writer.write_group(np.arange(4) + 4 * group, np.full(4, 3), np.arange(12) % NUM_ITEMS)
    meta = writer.close()
    segments = plan_rank(meta, 0, 1)
    reader = PreparedReader(tmp_path, meta)
    footer_bytes = [pq.ParquetFile(tmp_path / f.path).metadata.serialized_size + 8 for f in meta.files]
    for segment in segments:
        reader.read(segment)
    assert list(reader._footers) == [segments[1].path, segments[2].path]
    before = reader.bytes_read
    reader.read(segments[2])  # kept: parsed again, not read
    reader.read(segments[0])  # dropped as the oldest: its footer is read again
    group_bytes = [
        sum(g.column(c).total_compressed_size for c in range(g.num_columns))
        for g in (pq.ParquetFile(tmp_path / f.path).metadata.row_group(0) for f in meta.files)
    ]
    assert reader.bytes_read - before == group_bytes[2] + footer_bytes[0] + group_bytes[0]
    assert list(reader._footers) == [segments[2].path, segments[0].path]


def test_a_footer_longer_than_its_file(directory):
    path = directory / PART
    data = bytearray(path.read_bytes())
    data[-8:-4] = (len(data) + 1).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(PreparedDataError, match=r"part-00000.parquet: not a readable parquet file .*footer claims"):
        _read_all(directory)
