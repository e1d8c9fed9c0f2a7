"""The prepared-data contract v1: metadata round trips, validation errors that name the file and field, describe."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lightning_recsys.data.parquet.contract import (
    FORMAT,
    METADATA_FILE,
    VERSION,
    FileInfo,
    PreparedBy,
    PreparedDataError,
    PreparedMetadata,
    RowGroupInfo,
    part_file_name,
    read_metadata,
    row_group_bounds,
    write_metadata,
)
from lightning_recsys.data.parquet.describe import describe_directory


def _metadata(**overrides: object) -> PreparedMetadata:
    fields: dict[str, object] = dict(
        num_items=5,
        oov_row=4,
        oov_items=2,
        oov_events=3,
        num_users=3,
        num_events=7,
        users_with_one_event=1,
        num_action_types=0,
        user_id_type="int64",
        has_actions=False,
        has_timestamps=True,
        files=(FileInfo(part_file_name(0), 3, 7, (RowGroupInfo(2, 3, (1, 1, 0)), RowGroupInfo(1, 4, (0, 0, 0)))),),
        prepared_by=PreparedBy("test", "0.0"),
    )
    fields.update(overrides)
    return PreparedMetadata(**fields)  # type: ignore[arg-type]


def test_metadata_round_trips(tmp_path: Path) -> None:
    metadata = _metadata(action_values=None)
    write_metadata(tmp_path, metadata)
    assert read_metadata(tmp_path) == metadata
    data = json.loads((tmp_path / METADATA_FILE).read_text())
    assert data["format"] == FORMAT and data["version"] == VERSION
    assert data["files"][0]["row_groups"][0] == {"num_rows": 2, "num_events": 3, "short_users": [1, 1, 0]}


def test_row_groups_give_global_user_offsets() -> None:
    files = (
        FileInfo(part_file_name(0), 3, 7, (RowGroupInfo(2, 3, (1, 1, 0)), RowGroupInfo(1, 4, (0, 0, 0)))),
        FileInfo(part_file_name(1), 2, 2, (RowGroupInfo(2, 2, (2, 0, 0)),)),
    )
    metadata = _metadata(files=files, num_users=5, num_events=9, users_with_one_event=3)
    refs = list(metadata.row_groups())
    assert [(r.file_index, r.row_group, r.first_user, r.num_rows) for r in refs] == [(0, 0, 0, 2), (0, 1, 2, 1), (1, 0, 3, 2)]
    assert metadata.vocabulary_size == 4


def test_row_groups_holding_a_user_range_are_those_a_full_scan_finds() -> None:
    sizes = [[2, 0, 3], [0], [1, 4, 0, 0, 2], [5]]  # empty row groups and an empty file included
    files = tuple(
        FileInfo(part_file_name(i), sum(rows), sum(rows), tuple(RowGroupInfo(n, n, (0, 0, 0)) for n in rows))
        for i, rows in enumerate(sizes)
    )
    total = sum(map(sum, sizes))
    metadata = _metadata(files=files, num_users=total, num_events=total, users_with_one_event=0)
    refs = list(metadata.row_groups())
    assert len(refs) == sum(map(len, sizes))
    for lo in range(total + 1):
        for hi in range(lo, total + 2):
            scanned = [r for r in refs if r.num_rows and r.first_user < hi and r.first_user + r.num_rows > lo]
            assert list(metadata.row_groups_holding(lo, hi)) == scanned, (lo, hi)


def _write_with(tmp_path: Path, **changes: object) -> None:
    data = _metadata().to_dict()
    for key, value in changes.items():
        if value is _DELETE:
            del data[key]
        else:
            data[key] = value
    (tmp_path / METADATA_FILE).write_text(json.dumps(data))


_DELETE = object()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"format": "other"}, "field 'format'"),
        ({"version": 2}, "field 'version' is 2"),
        ({"num_items": "5"}, "field 'num_items' must be an integer"),
        ({"num_items": _DELETE}, "field 'num_items' is missing"),
        ({"oov_row": 3}, "field 'oov_row' must be num_items - 1 = 4"),
        ({"num_users": 4}, "field 'num_users' is 4 but the files' row groups sum to 3"),
        ({"num_events": 8}, "field 'num_events' is 8"),
        ({"users_with_one_event": 0}, "field 'users_with_one_event'"),
        ({"user_id_type": "float"}, "field 'user_id_type'"),
        ({"has_actions": 1}, "field 'has_actions' must be a boolean"),
        ({"num_action_types": 3}, "field 'num_action_types'"),
        ({"files": []}, "field 'files' is empty"),
        ({"files": [{"path": "/abs.parquet", "num_rows": 3, "num_events": 7, "row_groups": []}]}, "must be relative"),
        ({"files": [{"path": "users/a.parquet", "num_rows": 3, "num_events": 7, "row_groups": [{"num_rows": 3, "num_events": 7, "short_users": [1]}]}]}, "short_users"),
        ({"files": [{"path": "users/a.parquet", "num_rows": 3, "num_events": 7, "row_groups": [{"num_rows": 3, "num_events": 6, "short_users": [1, 0, 0]}]}]}, "row groups sum to 3, 6"),
        ({"prepared_by": {"tool": "x"}}, "field 'prepared_by.package_version' is missing"),
    ],
)
def test_bad_metadata_names_the_file_and_field(tmp_path: Path, changes: dict[str, object], message: str) -> None:
    _write_with(tmp_path, **changes)
    with pytest.raises(PreparedDataError, match=message) as caught:
        read_metadata(tmp_path)
    assert str(tmp_path / METADATA_FILE) in str(caught.value)


def test_missing_and_invalid_metadata(tmp_path: Path) -> None:
    with pytest.raises(PreparedDataError, match="missing.*--describe"):
        read_metadata(tmp_path)
    (tmp_path / METADATA_FILE).write_text("{not json")
    with pytest.raises(PreparedDataError, match="not valid JSON"):
        read_metadata(tmp_path)
    with pytest.raises(PreparedDataError, match="not a directory"):
        read_metadata(tmp_path / "nowhere")


def test_row_group_bounds_close_at_cumulative_events() -> None:
    assert row_group_bounds([3, 3, 3, 3], 6) == [0, 2, 4]
    assert row_group_bounds([10, 1, 1], 5) == [0, 1, 3]
    assert row_group_bounds([1, 1, 1], 100) == [0, 3]
    assert row_group_bounds([], 5) == [0]


def _write_users(path: Path, rows: list[dict[str, object]], row_group_size: int = 2, item_type: pa.DataType = pa.int64()) -> None:
    schema = pa.schema([("user_id", pa.string()), ("item_rows", pa.list_(item_type)), ("timestamps", pa.list_(pa.int64()))])
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=row_group_size)


def _write_items(directory: Path, count: int) -> None:
    pq.write_table(pa.table({"item_id": [f"i{r}" for r in range(count)], "row": list(range(count)), "count": [1] * count}), directory / "items.parquet")


def _user(name: str, rows: list[int]) -> dict[str, object]:
    return {"user_id": name, "item_rows": rows, "timestamps": list(range(len(rows)))}


def test_describe_writes_metadata_for_another_engines_files(tmp_path: Path) -> None:
    _write_items(tmp_path, 3)
    _write_users(tmp_path / "users" / "part-0.parquet", [_user("a", [0]), _user("b", [1, 2]), _user("c", [0, 1, 3])])
    _write_users(tmp_path / "users" / "part-1.parquet", [_user("d", [2, 2, 2, 2])], item_type=pa.int32())
    (tmp_path / "users" / "_SUCCESS").write_text("")  # Spark's marker is not a user file
    metadata = describe_directory(tmp_path)
    assert read_metadata(tmp_path) == metadata
    assert (metadata.num_users, metadata.num_events, metadata.users_with_one_event) == (4, 10, 1)
    assert (metadata.num_items, metadata.oov_row, metadata.oov_events) == (4, 3, 1)  # row 3 is the OOV row
    assert [f.path for f in metadata.files] == ["users/part-0.parquet", "users/part-1.parquet"]
    assert [g.short_users for g in metadata.files[0].row_groups] == [(1, 1, 0), (0, 0, 1)]
    assert metadata.user_id_type == "string" and metadata.has_timestamps and not metadata.has_actions


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([_user("a", [0]), _user("b", [7])], r"row group 0, row 1: item_rows holds 7, outside 0 \.\. 3"),
        ([_user("a", [0]), _user("b", [-1])], r"row 1: item_rows holds -1"),
        ([_user("a", [0]), _user("b", [])], r"row 1: item_rows is empty"),
        ([_user("a", [0]), {"user_id": "b", "item_rows": [1, 2], "timestamps": [5]}], r"row 1: timestamps must be a list as long"),
        ([_user("a", [0]), _user("a", [1])], r"user 'a'.*more than one row|more than one row"),
    ],
)
def test_describe_rejects_bad_files(tmp_path: Path, rows: list[dict[str, object]], message: str) -> None:
    _write_items(tmp_path, 3)
    _write_users(tmp_path / "users" / "part-0.parquet", rows)
    with pytest.raises(PreparedDataError, match=message):
        describe_directory(tmp_path)
    assert not (tmp_path / METADATA_FILE).exists()


def test_describe_rejects_wrong_types_and_non_parquet(tmp_path: Path) -> None:
    _write_items(tmp_path, 3)
    users = tmp_path / "users"
    users.mkdir()
    pq.write_table(pa.table({"user_id": [1], "item_rows": [["x"]]}), users / "part-0.parquet")
    with pytest.raises(PreparedDataError, match=r"part-0.parquet: column 'item_rows' is list<element: string>"):
        describe_directory(tmp_path)
    (users / "part-0.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(PreparedDataError, match="part-0.parquet: not a readable parquet file"):
        describe_directory(tmp_path)
