"""Criteo TSV reader: feature mapping, rank slices, gzip, malformed lines and config validation."""

import gzip
import logging
import math
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_recsys.data.criteo.tsv import CRITEO_FEATURE_NAMES, CriteoConfig, CriteoDataModule, CriteoDataset
from lightning_recsys.data.readers import MalformedLineError

# Hand-written lines: label, 13 integer features, 26 categorical features.
LINE_A = "\t".join(
    ["1", "0", "1", "-2", "", "3", "7", "", "", "", "", "", "", "99"]
    + ["0000000a", "", "ffffffff"]
    + ["00000001"] * 22
    + ["0000001f"]
)
LINE_B = "0" + "\t" * 39  # every feature missing
LINE_C = "\t".join(["0"] + ["2"] * 13 + ["0000000B"] * 26)  # upper-case hex is hex too


def _numbered(i: int) -> str:
    """A valid line whose first integer feature is ``i`` (recovered as ``expm1(dense[:, 0])``) and label ``i % 2``."""
    return "\t".join([str(i % 2), str(i)] + [""] * 12 + [f"{i:08x}"] * 26)


def _write(path, lines, compress=False) -> str:
    text = "".join(line + "\n" for line in lines)
    if compress:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return str(path)


def _ids(batch) -> list[int]:
    return [round(v) for v in torch.expm1(batch.dense[:, 0].double()).tolist()]


def _config(train, **kwargs) -> CriteoConfig:
    kwargs.setdefault("table_sizes", 10)
    return CriteoConfig(train_paths=train, **kwargs)


def test_hand_written_lines_map_to_expected_features(tmp_path):
    path = _write(tmp_path / "day_0.tsv", [LINE_A, LINE_B, LINE_C, LINE_A])
    config = _config([path], table_sizes=[10] * 25 + [7], global_batch_size=4)
    (batch,) = list(CriteoDataset(config, "train"))

    assert batch.labels.dtype == torch.float32 and batch.labels.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert batch.dense.dtype == torch.float32 and batch.dense.shape == (4, 13)
    # log(1 + x); missing and negative values are 0.
    expected_a = [0.0, math.log(2), 0.0, 0.0, math.log(4), math.log(8)] + [0.0] * 6 + [math.log(100)]
    torch.testing.assert_close(batch.dense[0], torch.tensor(expected_a))
    assert batch.dense[1].abs().sum().item() == 0.0
    torch.testing.assert_close(batch.dense[2], torch.full((13,), math.log(3)))

    kjt = batch.sparse
    assert kjt.keys() == CRITEO_FEATURE_NAMES == [f"cat_{i}" for i in range(26)]
    # cat_0: 0xa % 10 = 0; B is empty; 0xB % 10 = 1.
    assert kjt["cat_0"].lengths().tolist() == [1, 0, 1, 1] and kjt["cat_0"].values().tolist() == [0, 1, 0]
    # cat_1 is missing on line A: an empty bag, not some id.
    assert kjt["cat_1"].lengths().tolist() == [0, 0, 1, 0] and kjt["cat_1"].values().tolist() == [1]
    assert kjt["cat_2"].values().tolist() == [5, 1, 5]  # 0xffffffff % 10 = 5
    assert kjt["cat_3"].values().tolist() == [1, 1, 1]
    assert kjt["cat_25"].values().tolist() == [3, 4, 3]  # its own table of 7 rows: 0x1f % 7, 0xb % 7


def test_record_count_drops_the_partial_tail_and_spans_files(tmp_path):
    first = _write(tmp_path / "a.tsv", [_numbered(i) for i in range(5)])
    second = _write(tmp_path / "b.tsv", [_numbered(i) for i in range(5, 11)])
    batches = list(CriteoDataset(_config([first, second], global_batch_size=4), "train"))
    # 11 lines: two global batches of 4, the second spanning both files; the last 3 are dropped.
    assert [_ids(b) for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [b.labels.tolist() for b in batches] == [[0.0, 1.0, 0.0, 1.0], [0.0, 1.0, 0.0, 1.0]]
    # Files are read in the given order.
    reversed_batches = list(CriteoDataset(_config([second, first], global_batch_size=4), "train"))
    assert [_ids(b) for b in reversed_batches] == [[5, 6, 7, 8], [9, 10, 0, 1]]


def _same(a, b) -> bool:
    return (
        torch.equal(a.dense, b.dense)
        and torch.equal(a.labels, b.labels)
        and torch.equal(a.sparse.values(), b.sparse.values())
        and torch.equal(a.sparse.lengths(), b.sparse.lengths())
    )


def test_two_ranks_take_disjoint_halves_of_what_one_rank_gets(tmp_path):
    lines = [_numbered(i) for i in range(14)]
    lines[3] = LINE_B  # an example with empty bags must be sliced correctly too
    path = _write(tmp_path / "day.tsv", lines)
    config = _config([path], global_batch_size=4)
    whole = list(CriteoDataset(config, "train", rank=0, world_size=1))
    ranks = [list(CriteoDataset(config, "train", rank=r, world_size=2)) for r in range(2)]

    assert len(whole) == 3 and len(ranks[0]) == len(ranks[1]) == 3  # 14 = 3 * 4 + 2 dropped
    assert [_ids(b) for b in ranks[0]] == [[0, 1], [4, 5], [8, 9]]
    assert [_ids(b) for b in ranks[1]] == [[2, 0], [6, 7], [10, 11]]  # LINE_B has id 0
    for full, r0, r1 in zip(whole, *ranks):
        assert r0.batch_size == r1.batch_size == 2
        for key in CRITEO_FEATURE_NAMES:
            assert torch.equal(torch.cat([r0.sparse[key].values(), r1.sparse[key].values()]), full.sparse[key].values())
            assert torch.equal(torch.cat([r0.sparse[key].lengths(), r1.sparse[key].lengths()]), full.sparse[key].lengths())
        assert torch.equal(torch.cat([r0.dense, r1.dense]), full.dense)
        assert torch.equal(torch.cat([r0.labels, r1.labels]), full.labels)


def test_world_size_must_divide_the_global_batch(tmp_path):
    config = _config([_write(tmp_path / "d.tsv", [LINE_A])], global_batch_size=4)
    with pytest.raises(ValueError, match=r"global_batch_size=4 is not divisible by the world size 3; use a multiple of 3"):
        CriteoDataset(config, "train", rank=0, world_size=3)
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, world_size=2\)"):
        CriteoDataset(config, "train", rank=2, world_size=2)


def test_gzip_is_detected_by_content_and_matches_plain_text(tmp_path):
    lines = [_numbered(i) for i in range(6)] + [LINE_A, LINE_C]
    plain = _write(tmp_path / "day_0.tsv", lines)
    packed = _write(tmp_path / "day_0", lines, compress=True)  # no .gz suffix
    suffixed = _write(tmp_path / "day_0.tsv.gz", lines, compress=True)
    expected = list(CriteoDataset(_config([plain], global_batch_size=4), "train"))
    for path in (packed, suffixed):
        got = list(CriteoDataset(_config([path], global_batch_size=4), "train"))
        assert len(got) == len(expected) == 2 and all(_same(a, b) for a, b in zip(got, expected))


_BAD_LINES = [
    (LINE_A.rsplit("\t", 1)[0], r"expected 40 tab-separated fields .* found 39 \(39 is the unlabeled Kaggle test.txt"),
    ("2" + LINE_A[1:], r"label '2' \(field 1\) is not 0 or 1"),
    (LINE_A.replace("\t99\t", "\t9.5\t"), r"integer feature 12 \(field 14\) '9.5' is not an integer"),
    (LINE_A.replace("ffffffff", "0x1fffff"), r"categorical feature cat_2 \(field 17\) '0x1fffff' is not hexadecimal"),
    ("", r"found 1"),
]


@pytest.mark.parametrize(("bad", "problem"), _BAD_LINES)
def test_malformed_line_error_names_file_line_content_and_fix(tmp_path, bad, problem):
    path = _write(tmp_path / "day_7.tsv", [LINE_A, LINE_B, bad, LINE_C])
    with pytest.raises(MalformedLineError, match=problem) as info:
        list(CriteoDataset(_config([path], global_batch_size=2), "train"))
    message = str(info.value)
    assert message.startswith(f"{path}, line 3: ")
    assert repr(bad[:120]) in message or repr(bad[:120] + "...") in message
    assert "on_bad_line='skip'" in message
    assert isinstance(info.value, ValueError) and info.value.line_number == 3 and info.value.path == path


def test_long_lines_are_truncated_in_the_message(tmp_path):
    bad = LINE_A.replace("ffffffff", "zzzzzzzz")
    path = _write(tmp_path / "d.tsv", [bad])
    with pytest.raises(MalformedLineError) as info:
        list(CriteoDataset(_config([path], global_batch_size=1), "train"))
    assert repr(bad[:120] + "...") in str(info.value) and bad not in str(info.value)


def test_skip_counts_bad_lines_logs_once_per_file_and_keeps_ranks_in_step(tmp_path, caplog):
    first = _write(tmp_path / "a.tsv", [_numbered(0), "junk", _numbered(1), LINE_A.replace("0000000a", "g"), _numbered(2)])
    second = _write(tmp_path / "b.tsv", [_numbered(3), "2" + _numbered(4)[1:], _numbered(4), _numbered(5)])
    config = _config([first, second], global_batch_size=2, on_bad_line="skip")
    with caplog.at_level(logging.WARNING, logger="lightning_recsys.data.readers"):
        dataset = CriteoDataset(config, "train")
        batches = list(dataset)
    assert dataset.skipped_lines == 3
    assert [_ids(b) for b in batches] == [[0, 1], [2, 3], [4, 5]]
    warnings = [r.getMessage() for r in caplog.records if r.name == "lightning_recsys.data.readers"]
    assert len(warnings) == 2
    assert f"Skipped 2 malformed line(s) of {first}" in warnings[0] and "line 2:" in warnings[0]
    assert f"Skipped 1 malformed line(s) of {second}" in warnings[1]

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightning_recsys.data.readers"):
        r1 = CriteoDataset(config, "train", rank=1, world_size=2)
        assert [_ids(b) for b in r1] == [[1], [3], [5]]
    assert r1.skipped_lines == 3  # counted on every rank
    assert not [r for r in caplog.records if r.name == "lightning_recsys.data.readers"]  # rank 0 logs for everyone


def test_config_validation():
    cases = [
        ({"train_paths": "day_0.tsv"}, r"train_paths='day_0.tsv' must be a list of file paths; for one file write \['day_0.tsv'\]"),
        ({"train_paths": [], "val_paths": [""]}, r"val_paths=\[''\] contains an empty path"),
        ({"train_paths": []}, r"train_paths, val_paths and test_paths are all empty"),
        ({"train_paths": ["a"], "table_sizes": [10, 10, 10]}, r"table_sizes has 3 entries; give one size for all 26"),
        ({"train_paths": ["a"], "table_sizes": 0}, r"table_sizes=0 must be an integer >= 1"),
        ({"train_paths": ["a"], "table_sizes": [5] * 25 + [-1]}, r"table_sizes=\[5, .*-1\] must be an integer >= 1"),
        ({"train_paths": ["a"], "global_batch_size": 0}, r"global_batch_size=0 must be an integer >= 1"),
        ({"train_paths": ["a"], "on_bad_line": "ignore"}, r"on_bad_line='ignore' is not one of \['error', 'skip'\]"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            CriteoConfig(**kwargs)
    assert CriteoConfig(train_paths=["a"], table_sizes=7).feature_table_sizes() == [7] * 26


def test_datamodule_loaders_and_rank_from_trainer(tmp_path):
    train = _write(tmp_path / "train.tsv", [_numbered(i) for i in range(8)])
    test = _write(tmp_path / "test.tsv", [_numbered(i) for i in range(100, 104)])
    dm = CriteoDataModule.from_config(_config([train], test_paths=[test], table_sizes=[3] * 26, global_batch_size=4))
    assert dm.feature_names == CRITEO_FEATURE_NAMES and dm.table_sizes == [3] * 26 and dm.num_dense_features == 13
    assert [_ids(b) for b in dm.train_dataloader()] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert list(dm.val_dataloader()) == []  # no val files: an empty split
    assert [_ids(b) for b in dm.test_dataloader()] == [_ids(b) for b in dm.predict_dataloader()] == [[100, 101, 102, 103]]
    for batch in dm.train_dataloader():
        assert batch.sparse.values().max().item() < 3  # every id fits its table

    dm.trainer = SimpleNamespace(global_rank=1, world_size=2)  # what the loaders read from a Trainer
    assert [_ids(b) for b in dm.train_dataloader()] == [[4, 5], [6, 7]]  # the arrow reader: contiguous lines
    dm.config.reader = "python"  # the line-by-line reader: a slice of every global batch
    assert [_ids(b) for b in dm.train_dataloader()] == [[2, 3], [6, 7]]


def test_dataloader_workers_split_global_batches_without_duplicates(tmp_path):
    path = _write(tmp_path / "d.tsv", [_numbered(i) for i in range(11)])
    dataset = CriteoDataset(_config([path], global_batch_size=2), "train")
    batches = list(DataLoader(dataset, batch_size=None, num_workers=2))
    assert [_ids(b) for b in batches] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]


def test_a_file_listed_twice_in_a_split_is_refused_and_a_shared_val_file_warned(tmp_path):
    """Two spellings of one file are one file; a repeat was read twice per epoch without a word."""
    with pytest.raises(ValueError, match=r"train_paths=.* lists file\(s\) .*a.tsv more than once"):
        CriteoConfig(train_paths=[str(tmp_path / "a.tsv"), str(tmp_path / "b.tsv"), str(tmp_path / "." / "a.tsv")])
    with pytest.warns(UserWarning, match=r"test_paths and train_paths share file\(s\) [^,]*a.tsv: the test_paths metrics"):
        CriteoConfig(train_paths=[str(tmp_path / "a.tsv")], test_paths=[str(tmp_path / "b.tsv"), str(tmp_path / "a.tsv")])


@pytest.mark.parametrize("reader", ["python", "arrow"])
def test_a_missing_file_is_refused_when_the_loaders_are_made_naming_the_argument(tmp_path, reader):
    # A typo in val_paths surfaced only when validation first read the file: with reader="python" (or one
    # arrow rank) after a whole training epoch, as a bare FileNotFoundError that named no argument.
    train = _write(tmp_path / "day_0.tsv", [_numbered(i) for i in range(8)])
    missing = str(tmp_path / "day_1_typo.tsv")
    dm = CriteoDataModule([train], val_paths=[missing], table_sizes=10, global_batch_size=4, reader=reader)
    with pytest.raises(FileNotFoundError, match=r"val_paths\[0\]=.*day_1_typo\.tsv.* does not exist") as caught:
        dm.setup("fit")  # Lightning calls it on every rank before anything is sharded or trained
    assert "CriteoDataModule" in str(caught.value)
    dm.setup("test")  # no test files: nothing to check
    with pytest.raises(FileNotFoundError, match=r"val_paths\[0\]"):
        dm.val_dataloader()  # the dataset checks too (a loader made without setup, or a dataset built directly)
    assert len(list(dm.train_dataloader())) == 2

    # A directory is not a file either; test_paths is checked for test and predict.
    test = _write(tmp_path / "day_2.tsv", [_numbered(i) for i in range(4)])
    dm = CriteoDataModule([train], test_paths=[test, str(tmp_path)], table_sizes=10, global_batch_size=4, reader=reader)
    dm.setup("fit")
    for stage in ("test", "predict"):
        with pytest.raises(FileNotFoundError, match=r"test_paths\[1\]=.* is not a file"):
            dm.setup(stage)


@pytest.mark.parametrize("reader", ["python", "arrow"])
def test_skipped_lines_reach_the_main_process_with_dataloader_workers(tmp_path, reader):
    # The workers counted in their own copies of the dataset: the main process's skipped_lines read 0.
    lines = [_numbered(i) for i in range(10)]
    lines[1:1] = ["junk"]
    lines[6:6] = ["2" + _numbered(5)[1:]]  # a label that is not 0 or 1
    lines.append("x\ty")  # in the dropped partial global batch: still read, skipped and counted
    first = _write(tmp_path / "a.tsv", lines[:7])
    second = _write(tmp_path / "b.tsv", lines[7:])
    batches = {"python": 2, "arrow": 3}[reader]  # the arrow reader's batches are 4 lines, short by their skipped ones
    counts = {}
    for num_workers in (0, 2, 0):
        dm = CriteoDataModule([first, second], table_sizes=10, global_batch_size=4, on_bad_line="skip", reader=reader,
                              num_workers=num_workers)
        loader = dm.train_dataloader()
        for _ in range(2):  # a second pass counts its own skips, not both passes'
            assert len(list(loader)) == batches
            counts.setdefault(num_workers, []).append(loader.dataset.skipped_lines)
    assert counts == {0: [3, 3, 3, 3], 2: [3, 3]}

    # A dataset in a DataLoader made by hand counts the same, and so does a loader with more workers than batches.
    dataset = dm._dataset("train", 0, 1)
    for num_workers in (2, 4, 1):
        assert len(list(DataLoader(dataset, batch_size=None, num_workers=num_workers))) == batches
        assert dataset.skipped_lines == 3, num_workers
