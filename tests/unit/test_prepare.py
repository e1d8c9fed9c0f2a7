"""``lightning-recsys prepare``: raw events to the prepared contract, checked against a plain-Python grouping."""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("duckdb")

from lightning_recsys.cli.prepare import prepare_main  # noqa: E402
from lightning_recsys.data.parquet.contract import PreparedDataError, read_metadata, row_group_bounds  # noqa: E402
from lightning_recsys.data.parquet.prepare import PrepareConfig, prepare  # noqa: E402
from lightning_recsys.data.parquet.prepare_sql import PrepareError, translate_error  # noqa: E402
from lightning_recsys.data.parquet.synthetic_events import SyntheticEventsConfig, generate_events  # noqa: E402
from lightning_recsys.data.sequences.reader import read_sequence_file  # noqa: E402


def _users(directory: Path) -> list[dict[str, object]]:
    metadata = read_metadata(directory)
    rows: list[dict[str, object]] = []
    for info in metadata.files:
        rows.extend(pq.read_table(directory / info.path).to_pylist())
    return rows


def _items(directory: Path) -> list[dict[str, object]]:
    return pq.read_table(directory / "items.parquet").to_pylist()


def _raw_sequences(directory: Path) -> dict[object, list[object]]:
    """Each user's history as raw item ids (OOV events as None), through items.parquet."""
    by_row = {item["row"]: item["item_id"] for item in _items(directory)}
    return {user["user_id"]: [by_row.get(row) for row in user["item_rows"]] for user in _users(directory)}


def _expected(events: list[tuple[object, object, int]]) -> dict[object, list[object]]:
    """The oracle: group by user, order by time, ties by position in the input (a stable sort)."""
    grouped: dict[object, list[tuple[int, int, object]]] = defaultdict(list)
    for position, (user, item, ts) in enumerate(events):
        grouped[user].append((ts, position, item))
    return {user: [item for _, _, item in sorted(history)] for user, history in grouped.items()}


def _random_events(n: int, seed: int, string_ids: bool = False) -> list[tuple[object, object, int]]:
    rng = np.random.default_rng(seed)
    users = rng.integers(0, 40, size=n)
    items = np.minimum(rng.zipf(1.5, size=n), 60)
    times = rng.integers(0, 20, size=n)  # few distinct times: many ties
    if string_ids:
        return [(f"u{u}", f"i{i}", int(t)) for u, i, t in zip(users, items, times)]
    return [(int(u), int(i), int(t)) for u, i, t in zip(users, items, times)]


def _write_parquet(path: Path, events: list[tuple[object, object, int]]) -> None:
    users, items, times = zip(*events)
    pq.write_table(pa.table({"user_id": list(users), "item_id": list(items), "ts": list(times)}), path, row_group_size=97)


@pytest.mark.parametrize("string_ids", [False, True])
def test_parquet_events_group_by_user_in_time_order_with_input_order_ties(tmp_path: Path, string_ids: bool) -> None:
    events = _random_events(2_000, seed=1, string_ids=string_ids)
    # Two files: ties between them follow the file order given.
    _write_parquet(tmp_path / "b.parquet", events[:1200])
    _write_parquet(tmp_path / "a.parquet", events[1200:])
    out = tmp_path / "out"
    metadata = prepare(
        PrepareConfig(inputs=(str(tmp_path / "b.parquet"), str(tmp_path / "a.parquet")), output=str(out), time_column="ts",
                      row_group_events=150, file_events=700, threads=2)
    )
    assert _raw_sequences(out) == _expected(events)
    users = _users(out)
    assert [u["user_id"] for u in users] == sorted(u["user_id"] for u in users)  # users in id order
    for user in users:
        assert user["timestamps"] == sorted(user["timestamps"])
    assert metadata.num_events == 2_000 and metadata.num_users == len({e[0] for e in events})
    assert metadata.user_id_type == ("string" if string_ids else "int64")
    assert metadata.has_timestamps and not metadata.has_actions and metadata.oov_row is None
    assert len(metadata.files) > 1 and all(len(f.row_groups) >= 1 for f in metadata.files)
    for info in metadata.files:  # the metadata agrees with the parquet footers
        footer = pq.ParquetFile(out / info.path).metadata
        assert [footer.row_group(i).num_rows for i in range(footer.num_row_groups)] == [g.num_rows for g in info.row_groups]
    # Row groups close at the first user that brings them to 150 events (the contract's rule).
    lengths = [len(u["item_rows"]) for u in users]
    assert [g.num_rows for f in metadata.files for g in f.row_groups] == list(np.diff(row_group_bounds(lengths, 150)))
    assert not (out / ".prepare-tmp").exists()


def test_item_rows_follow_frequency_then_raw_id(tmp_path: Path) -> None:
    events = [(1, 30, 0), (1, 20, 1), (2, 20, 0), (2, 10, 1), (3, 10, 0), (3, 40, 1), (3, 30, 2)]
    _write_parquet(tmp_path / "e.parquet", events)
    prepare(PrepareConfig(inputs=(str(tmp_path / "e.parquet"),), output=str(tmp_path / "out"), time_column="ts"))
    # counts: 10:2, 20:2, 30:2, 40:1 -> ties by raw id ascending
    assert _items(tmp_path / "out") == [
        {"item_id": 10, "row": 0, "count": 2}, {"item_id": 20, "row": 1, "count": 2},
        {"item_id": 30, "row": 2, "count": 2}, {"item_id": 40, "row": 3, "count": 1},
    ]


def test_min_item_count_sends_rare_items_to_the_oov_row_and_counts_them(tmp_path: Path) -> None:
    events = _random_events(1_500, seed=2)
    _write_parquet(tmp_path / "e.parquet", events)
    metadata = prepare(PrepareConfig(inputs=(str(tmp_path / "e.parquet"),), output=str(tmp_path / "out"), time_column="ts", min_item_count=5))
    counts = Counter(item for _, item, _ in events)
    rare = {item for item, n in counts.items() if n < 5}
    assert rare, "the data must have rare items for this test to mean anything"
    assert metadata.oov_items == len(rare) and metadata.oov_events == sum(counts[i] for i in rare)
    assert metadata.oov_row == metadata.num_items - 1 == len(counts) - len(rare)
    expected = {user: [None if item in rare else item for item in history] for user, history in _expected(events).items()}
    assert _raw_sequences(tmp_path / "out") == expected


def test_users_with_one_event_and_short_users_are_counted(tmp_path: Path) -> None:
    events = [(1, 5, 0), (2, 5, 0), (2, 6, 1), (3, 5, 0), (3, 6, 1), (3, 7, 2), (4, 7, 0)]
    _write_parquet(tmp_path / "e.parquet", events)
    metadata = prepare(PrepareConfig(inputs=(str(tmp_path / "e.parquet"),), output=str(tmp_path / "out"), time_column="ts"))
    assert metadata.users_with_one_event == 2
    assert [g.short_users for f in metadata.files for g in f.row_groups] == [(2, 1, 1)]


def test_csv_with_actions_and_input_order_ties(tmp_path: Path) -> None:
    lines = ["user,item,when,kind", "u1,a,5,click", "u1,b,5,buy", "u2,a,1,click", "u1,c,4,click", "u2,c,1,buy"]
    (tmp_path / "e.csv").write_text("\n".join(lines) + "\n")
    metadata = prepare(
        PrepareConfig(inputs=(str(tmp_path / "e.csv"),), output=str(tmp_path / "out"), user_column="user", item_column="item",
                      time_column="when", action_column="kind")
    )
    assert _raw_sequences(tmp_path / "out") == {"u1": ["c", "a", "b"], "u2": ["a", "c"]}
    assert metadata.action_values == ("buy", "click") and metadata.num_action_types == 2
    assert {u["user_id"]: u["actions"] for u in _users(tmp_path / "out")} == {"u1": [1, 1, 0], "u2": [1, 0]}


def test_user_item_lines_keep_line_order(tmp_path: Path) -> None:
    (tmp_path / "seq.txt").write_text("7 100\n3 200\n7 300\n\n3 100\n7 100\n")
    metadata = prepare(PrepareConfig(inputs=(str(tmp_path / "seq.txt"),), output=str(tmp_path / "out"), input_format="user-item-lines"))
    assert _raw_sequences(tmp_path / "out") == {7: [100, 300, 100], 3: [200, 100]}
    assert metadata.user_id_type == "int64" and not metadata.has_timestamps and metadata.prepared_by.input_format == "user-item-lines"


def test_user_items_lines_with_string_ids(tmp_path: Path) -> None:
    (tmp_path / "seq.txt").write_text("alice x y x\nbob  y\ncarol z x\n")
    metadata = prepare(PrepareConfig(inputs=(str(tmp_path / "seq.txt"),), output=str(tmp_path / "out"), input_format="user-items-lines"))
    assert _raw_sequences(tmp_path / "out") == {"alice": ["x", "y", "x"], "bob": ["y"], "carol": ["z", "x"]}
    assert metadata.user_id_type == "string" and metadata.users_with_one_event == 1


def test_beauty_like_text_file_equals_the_text_path(tmp_path: Path) -> None:
    """The prepared users' sequences, mapped through items.parquet, equal what the text reader reads."""
    rng = np.random.default_rng(3)
    lines = []
    for user in range(1, 60):
        for _ in range(int(rng.integers(1, 12))):
            lines.append(f"{user} {int(rng.zipf(1.3)) % 80 + 1}")
    path = tmp_path / "beauty.txt"
    path.write_text("\n".join(lines) + "\n")
    text = read_sequence_file(path)
    prepare(PrepareConfig(inputs=(str(path),), output=str(tmp_path / "out"), input_format="user-item-lines", row_group_events=50))
    prepared = _raw_sequences(tmp_path / "out")
    expected = {
        int(text.user_ids[u]): [int(row) + 1 for row in text.items[text.offsets[u]: text.offsets[u + 1]]] for u in range(text.num_users)
    }
    assert prepared == expected


def test_long_user_across_batches_and_row_groups(tmp_path: Path) -> None:
    events = [(1, i % 7, i) for i in range(50)] + [(2, 3, 0)] + [(3, i % 5, i) for i in range(20)]
    _write_parquet(tmp_path / "e.parquet", events)
    # row_group_events=4 also makes the DuckDB batches 4 events: user 1 spans many of them.
    metadata = prepare(PrepareConfig(inputs=(str(tmp_path / "e.parquet"),), output=str(tmp_path / "out"), time_column="ts", row_group_events=4))
    assert _raw_sequences(tmp_path / "out") == _expected(events)
    assert [g.num_rows for f in metadata.files for g in f.row_groups] == [1, 2]


def test_malformed_csv_names_the_file_and_line_or_skips_and_counts(tmp_path: Path) -> None:
    path = tmp_path / "e.csv"
    path.write_text("user_id,item_id,ts\n1,a,5\n1,b,6\n2,a,x\n3,c,1\n")
    with pytest.raises(PrepareError, match=r"(?s)e\.csv.*[Ll]ine.*--on-bad-line skip"):
        prepare(PrepareConfig(inputs=(str(path),), output=str(tmp_path / "out"), time_column="ts", id_type="string"))
    lines: list[str] = []
    metadata = prepare(
        PrepareConfig(inputs=(str(path),), output=str(tmp_path / "out"), time_column="ts", id_type="string", on_bad_line="skip", overwrite=True),
        report=lines.append,
    )
    assert metadata.num_events == 3
    assert any("skipped 1 malformed line" in line for line in lines)


def test_malformed_text_line_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "seq.txt"
    path.write_text("1 10\n1 11\n\n2 10 99\n")
    with pytest.raises(PrepareError, match=r"seq\.txt, line 4: '2 10 99'"):
        prepare(PrepareConfig(inputs=(str(path),), output=str(tmp_path / "out"), input_format="user-item-lines"))
    lines: list[str] = []
    metadata = prepare(PrepareConfig(inputs=(str(path),), output=str(tmp_path / "out"), input_format="user-item-lines", on_bad_line="skip", overwrite=True), report=lines.append)
    assert metadata.num_events == 2 and any("skipped 1 malformed" in line for line in lines)


def test_missing_column_empty_input_and_nulls(tmp_path: Path) -> None:
    _write_parquet(tmp_path / "e.parquet", [(1, 2, 3)])
    with pytest.raises(PrepareError, match=r"--time-column 'time': no such column in .*e\.parquet.*'ts'"):
        prepare(PrepareConfig(inputs=(str(tmp_path / "e.parquet"),), output=str(tmp_path / "o1"), time_column="time"))
    pq.write_table(pa.table({"user_id": pa.array([], pa.int64()), "item_id": pa.array([], pa.int64())}), tmp_path / "empty.parquet")
    with pytest.raises(PrepareError, match="hold no events"):
        prepare(PrepareConfig(inputs=(str(tmp_path / "empty.parquet"),), output=str(tmp_path / "o2")))
    pq.write_table(pa.table({"user_id": [1, None], "item_id": [1, 2]}), tmp_path / "nulls.parquet")
    with pytest.raises(PrepareError, match="1 of 2 events have a null user"):
        prepare(PrepareConfig(inputs=(str(tmp_path / "nulls.parquet"),), output=str(tmp_path / "o3")))
    with pytest.raises(PrepareError, match="no such file, directory or matching glob"):
        prepare(PrepareConfig(inputs=(str(tmp_path / "none*.parquet"),), output=str(tmp_path / "o4")))


def test_full_temp_disk_names_the_directory_and_the_flags(tmp_path: Path) -> None:
    raw = tmp_path / "raw.parquet"
    generate_events(raw, SyntheticEventsConfig(num_events=300_000, num_items=50_000, string_ids=True))
    temp = tmp_path / "spill"
    with pytest.raises(PrepareError, match=rf"(?s)temporary disk space in {temp}.*--temp-directory.*--max-temp-size"):
        prepare(PrepareConfig(inputs=(str(raw),), output=str(tmp_path / "out"), time_column="ts", memory_limit="20MB",
                              max_temp_size="1MB", threads=1, temp_directory=str(temp)))
    import duckdb

    translated = translate_error(duckdb.IOException("IO Error: Could not write file: No space left on device"), temp, "2GB")
    assert isinstance(translated, PrepareError) and str(temp) in str(translated) and "--temp-directory" in str(translated)


def test_config_errors_name_the_argument_value_and_rule(tmp_path: Path) -> None:
    with pytest.raises(PreparedDataError, match=r"min_item_count=0: must be an integer >= 1"):
        PrepareConfig(inputs=("x",), output="o", min_item_count=0)
    with pytest.raises(PreparedDataError, match=r"memory_limit='lots': must be a size"):
        PrepareConfig(inputs=("x",), output="o", memory_limit="lots")
    with pytest.raises(PreparedDataError, match=r"input_format='xml'"):
        PrepareConfig(inputs=("x",), output="o", input_format="xml")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    _write_parquet(tmp_path / "e.parquet", [(1, 2, 3)])
    with pytest.raises(PrepareError, match="not empty; use --overwrite"):
        prepare(PrepareConfig(inputs=(str(tmp_path / "e.parquet"),), output=str(tmp_path / "out")))


def test_cli_synthetic_prepare_and_describe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = tmp_path / "raw.parquet"
    assert prepare_main(["--synthetic-events", "5000", "--output-raw", str(raw), "--string-ids", "--num-items", "300"]) == 0
    out = tmp_path / "out"
    assert prepare_main(["--input", str(raw), "--output", str(out), "--time-column", "ts", "--row-group-events", "1000"]) == 0
    metadata = read_metadata(out)
    assert metadata.num_events == 5000 and metadata.user_id_type == "string"
    (out / "metadata.json").unlink()
    assert prepare_main(["--describe", str(out)]) == 0
    described = read_metadata(out)
    assert (described.files, described.num_items, described.num_users) == (metadata.files, metadata.num_items, metadata.num_users)
    assert prepare_main(["--input", str(raw), "--output", str(tmp_path / "o2"), "--time-column", "nope"]) == 1
    assert "--time-column 'nope'" in capsys.readouterr().err


def test_missing_duckdb_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "duckdb", None)
    assert prepare_main(["--input", str(tmp_path), "--output", str(tmp_path / "o")]) == 1
    assert "pip install 'lightning-recsys[prepare]'" in capsys.readouterr().err


def test_synthetic_events_lengths_ids_and_bounded_chunks(tmp_path: Path) -> None:
    path = tmp_path / "raw.parquet"
    counts = generate_events(path, SyntheticEventsConfig(num_events=60_000, mean_length=9.0, chunk_events=25_000, num_items=1_000))
    table = pq.read_table(path)
    assert counts["events"] == table.num_rows == 60_000
    assert pq.ParquetFile(path).metadata.num_row_groups == 3
    lengths = np.array(list(Counter(table.column("user_id").to_pylist()).values()))
    assert 7.0 < lengths.mean() < 11.0 and lengths.min() >= 1
    items = Counter(table.column("item_id").to_pylist())
    top = items.most_common(1)[0][1]
    assert top > 20 * np.median(list(items.values()))  # Zipf: a head far above the median
    long = generate_events(tmp_path / "long.parquet", SyntheticEventsConfig(num_events=40_000, mean_length=200.0, length_sigma=0.5))
    assert 150 < 40_000 / long["users"] < 260


def test_the_documented_duckdb_query_writes_what_prepare_writes(tmp_path: Path) -> None:
    """The DuckDB grouping query of docs/datasets.md, then --describe, equals prepare's output."""
    import duckdb

    docs = (Path(__file__).resolve().parents[2] / "docs" / "datasets.md").read_text()
    section = docs[docs.index("### Writing the contract with another engine"):]
    query = section[section.index("```sql") + len("```sql"): section.index("```", section.index("```sql") + 6)]
    events = _random_events(3_000, seed=4, string_ids=True)
    (tmp_path / "events").mkdir()
    _write_parquet(tmp_path / "events" / "0.parquet", events[:1000])
    _write_parquet(tmp_path / "events" / "1.parquet", events[1000:])
    (tmp_path / "DIR" / "users").mkdir(parents=True)
    query = query.replace("'events/*.parquet'", f"'{tmp_path}/events/*.parquet'").replace("'DIR/", f"'{tmp_path}/DIR/")
    con = duckdb.connect()
    con.execute(query)
    con.close()
    assert prepare_main(["--describe", str(tmp_path / "DIR")]) == 0
    prepare(PrepareConfig(inputs=(str(tmp_path / "events"),), output=str(tmp_path / "P"), time_column="ts"))
    assert _users(tmp_path / "DIR") == _users(tmp_path / "P")
    assert _items(tmp_path / "DIR") == _items(tmp_path / "P")
    assert _raw_sequences(tmp_path / "P") == _expected(events)


def test_integer_actions_are_kept_and_negative_ones_refused(tmp_path: Path) -> None:
    pq.write_table(pa.table({"user_id": [1, 1, 2], "item_id": [5, 6, 5], "ts": [2, 1, 1], "act": [0, 3, 1]}), tmp_path / "e.parquet")
    metadata = prepare(PrepareConfig(inputs=(str(tmp_path / "e.parquet"),), output=str(tmp_path / "out"), time_column="ts", action_column="act"))
    assert metadata.num_action_types == 4 and metadata.action_values is None
    assert {u["user_id"]: u["actions"] for u in _users(tmp_path / "out")} == {1: [3, 0], 2: [1]}
    pq.write_table(pa.table({"user_id": [1], "item_id": [5], "act": [-1]}), tmp_path / "neg.parquet")
    with pytest.raises(PrepareError, match="actions must be integers >= 0"):
        prepare(PrepareConfig(inputs=(str(tmp_path / "neg.parquet"),), output=str(tmp_path / "o2"), action_column="act"))


def test_id_type_int_on_string_ids_fails_clearly(tmp_path: Path) -> None:
    (tmp_path / "seq.txt").write_text("1 a\n2 b\n")
    with pytest.raises(PrepareError, match="--id-type"):
        prepare(PrepareConfig(inputs=(str(tmp_path / "seq.txt"),), output=str(tmp_path / "out"), input_format="user-item-lines", id_type="int"))


def test_glob_input_and_timestamp_column_stored_as_unix_seconds(tmp_path: Path) -> None:
    import datetime

    base = datetime.datetime(2024, 1, 1, tzinfo=None)
    times = [base + datetime.timedelta(seconds=s) for s in (30, 10, 20)]
    for index, (user, item, when) in enumerate(zip([1, 1, 2], ["a", "b", "a"], times)):
        pq.write_table(pa.table({"user_id": [user], "item_id": [item], "ts": pa.array([when], pa.timestamp("us"))}), tmp_path / f"e{index}.parquet")
    metadata = prepare(PrepareConfig(inputs=(str(tmp_path / "e*.parquet"),), output=str(tmp_path / "out"), time_column="ts"))
    assert metadata.num_events == 3 and len(metadata.prepared_by.inputs) == 1
    epoch = int(base.replace(tzinfo=datetime.timezone.utc).timestamp())
    assert {u["user_id"]: u["timestamps"] for u in _users(tmp_path / "out")} == {1: [epoch + 10, epoch + 30], 2: [epoch + 20]}
    assert _raw_sequences(tmp_path / "out") == {1: ["b", "a"], 2: ["a"]}


def test_compressed_csv_and_tsv(tmp_path: Path) -> None:
    import gzip

    with gzip.open(tmp_path / "e.csv.gz", "wt") as handle:
        handle.write("user_id,item_id,ts\n1,a,2\n1,b,1\n2,a,1\n")
    (tmp_path / "e.tsv").write_text("user_id\titem_id\tts\n1\ta\t2\n1\tb\t1\n2\ta\t1\n")
    for name in ("e.csv.gz", "e.tsv"):
        prepare(PrepareConfig(inputs=(str(tmp_path / name),), output=str(tmp_path / name.replace(".", "_")), time_column="ts"))
        assert _raw_sequences(tmp_path / name.replace(".", "_")) == {1: ["b", "a"], 2: ["a"]}
