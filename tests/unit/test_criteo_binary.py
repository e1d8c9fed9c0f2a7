"""TorchRec's npy Criteo format: files made by TorchRec's own tsv_to_npys, read back exactly, sliced per rank."""

import gzip
import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

pytest.importorskip("iopath", reason="the npy reader needs iopath: pip install 'lightning-recsys[criteo]'")

from torchrec.datasets.criteo import BinaryCriteoUtils  # noqa: E402

from lightning_recsys.data.criteo.tsv import CRITEO_FEATURE_NAMES  # noqa: E402
from lightning_recsys.data.criteo.binary import (  # noqa: E402
    CriteoBinaryConfig,
    CriteoBinaryDataModule,
    CriteoBinaryDataset,
    convert_tsv_to_npy,
    day_file,
)
from lightning_recsys.data.criteo.to_npy import main  # noqa: E402

SIZES = [7, 1000, 2**31 - 1] + [97] * 23


def _fields(rng: random.Random, i: int) -> list[str]:
    """Label, 13 integers (the first is ``i``, some missing or negative), 26 hex values (some missing)."""
    ints = [str(i)] + [rng.choice(["", "0", "-1", "5", "31", str(rng.randrange(10**6))]) for _ in range(12)]
    cats = [rng.choice(["", f"{rng.randrange(2**32):08x}", "0000000a"]) for _ in range(26)]
    return [str(rng.randrange(2))] + ints + cats


def _days(tmp_path, rows_per_day=(23, 17, 11)):
    """TSV files per day and, for each, its parsed fields."""
    rng, paths, fields, start = random.Random(0), [], [], 0
    for day, rows in enumerate(rows_per_day):
        day_fields = [_fields(rng, start + i) for i in range(rows)]
        start += rows
        path = tmp_path / f"day_{day}"
        path.write_text("".join("\t".join(f) + "\n" for f in day_fields))
        paths.append(str(path))
        fields.append(day_fields)
    return paths, fields


def _torchrec_npys(tsv_paths, out_dir) -> None:
    for day, path in enumerate(tsv_paths):
        BinaryCriteoUtils.tsv_to_npys(path, *(day_file(out_dir, day, kind) for kind in ("dense", "sparse", "labels")))


def _expected(day_fields):
    """What the DataModule must yield for one day's lines, computed from the TSV by hand."""
    raw = np.array([[int(x or "0") for x in f[1:14]] for f in day_fields], dtype=np.int64)
    low = raw.min()  # tsv_to_npys: missing counts as 0, then x - min + 2, then ln
    dense = [[math.log(x - low + 2) for x in row] for row in raw.tolist()]
    ids = [[int(x or "0", 16) % size for x, size in zip(f[14:], SIZES)] for f in day_fields]
    labels = [float(f[0]) for f in day_fields]
    return labels, dense, ids


@pytest.fixture
def npy_dir(tmp_path):
    tsv, fields = _days(tmp_path)
    out = tmp_path / "npy"
    out.mkdir()
    _torchrec_npys(tsv, str(out))
    return out, tsv, fields


def test_reads_exactly_what_torchrecs_tsv_to_npys_wrote(npy_dir):
    out, _, fields = npy_dir
    dm = CriteoBinaryDataModule(str(out), train_days=[0, 1], test_days=[2], table_sizes=SIZES, global_batch_size=8)
    assert dm.feature_names == CRITEO_FEATURE_NAMES and dm.num_dense_features == 13 and dm.table_sizes == SIZES
    batches = list(dm.train_dataloader())
    assert len(batches) == (23 + 17) // 8  # 5 global batches; batch 2 spans days 0 and 1
    labels, dense, ids = (sum(part, []) for part in zip(_expected(fields[0]), _expected(fields[1])))
    got_labels = torch.cat([b.labels for b in batches])
    assert got_labels.dtype == torch.float32 and got_labels.tolist() == labels[:40]
    got_dense = torch.cat([b.dense for b in batches])
    assert got_dense.dtype == torch.float32
    torch.testing.assert_close(got_dense, torch.tensor(dense[:40], dtype=torch.float32))
    # The stored float32 values, unchanged.
    stored = np.concatenate([np.load(day_file(out, d, "dense")) for d in (0, 1)])[:40]
    assert torch.equal(got_dense, torch.from_numpy(stored))
    for batch, first in zip(batches, range(0, 40, 8)):
        kjt = batch.sparse
        assert kjt.keys() == CRITEO_FEATURE_NAMES and kjt.stride() == 8
        assert kjt.lengths().tolist() == [1] * 26 * 8  # a missing value is stored as 0: id 0, never an empty bag
        for f, key in enumerate(CRITEO_FEATURE_NAMES):
            assert kjt[key].values().tolist() == [row[f] for row in ids[first : first + 8]]
    # This day's minimum is -1, so a missing dense value is ln(0 + 1 + 2) = ln 3 (our TSV readers: 0).
    assert min(int(x or "0") for f in fields[0] for x in f[1:14]) == -1
    row, col = next((r, c) for r, f in enumerate(fields[0]) for c, x in enumerate(f[1:14]) if x == "")
    assert math.isclose(got_dense[row, col].item(), math.log(3), rel_tol=1e-6)
    (test_batch,) = list(dm.test_dataloader())  # 11 rows: one batch of 8
    assert test_batch.labels.tolist() == _expected(fields[2])[0][:8]
    assert list(dm.val_dataloader()) == []


def test_rank_slices_are_disjoint_contiguous_and_cover_the_full_batches(npy_dir):
    out, _, fields = npy_dir
    every = sum(fields, [])  # 51 rows
    row_of = {}
    for day in range(3):
        for i, row in enumerate(np.load(day_file(out, day, "dense")).tolist()):
            row_of[tuple(row)] = int(sum(len(f) for f in fields[:day]) + i)
    assert len(row_of) == len(every)  # each row is told apart by its dense values
    config = CriteoBinaryConfig(path=str(out), train_days=[0, 1, 2], table_sizes=SIZES, global_batch_size=12)
    for world_size, num_workers in [(1, 0), (2, 0), (3, 2), (4, 3), (6, 0)]:
        union = []
        for rank in range(world_size):
            dataset = CriteoBinaryDataset(config, "train", rank, world_size)
            batches = list(DataLoader(dataset, batch_size=None, num_workers=num_workers))
            assert len(batches) == len(dataset) == 51 // 12 and all(b.batch_size == 12 // world_size for b in batches)
            rows = [row_of[tuple(r)] for b in batches for r in b.dense.tolist()]
            b = 12 // world_size
            assert rows == list(range(rank * 4 * b, (rank + 1) * 4 * b))  # contiguous, in order
            union += rows
        assert sorted(union) == list(range(48)), (world_size, num_workers)


def test_our_converter_writes_torchrecs_arrays_from_plain_and_gzip(npy_dir, tmp_path):
    out, tsv, _ = npy_dir
    packed = tmp_path / "day_1.gz"
    with open(tsv[1], "rb") as plain, gzip.open(packed, "wb") as gz:
        gz.write(plain.read())
    mine = tmp_path / "mine"
    main([tsv[0], str(packed), "--out-dir", str(mine), "--no-progress"])  # days from the names: 0 and 1
    assert convert_tsv_to_npy(tsv[2], str(mine), 2, progress=False, window_bytes=300) == 11
    for day in range(3):
        for kind in ("dense", "sparse", "labels"):
            theirs, ours = np.load(day_file(out, day, kind)), np.load(day_file(mine, day, kind))
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape and np.array_equal(ours, theirs), (day, kind)


def test_converter_reports_malformed_lines_like_the_tsv_readers(tmp_path):
    path = tmp_path / "day_0"
    path.write_text("1\t" + "\t" * 38 + "\n" + "2" + "\t" * 39 + "\n")
    from lightning_recsys.data.readers import MalformedLineError

    with pytest.raises(MalformedLineError, match=r"day_0, line 2: label '2' \(field 1\) is not 0 or 1"):
        convert_tsv_to_npy(str(path), str(tmp_path / "out"), 0, progress=False)
    assert convert_tsv_to_npy(str(path), str(tmp_path / "out"), 0, on_bad_line="skip", progress=False) == 1


def test_config_validation_and_missing_files(tmp_path):
    cases = [
        ({"train_days": 0}, r"train_days=0 must be a list of day numbers"),
        ({"train_days": [-1]}, r"train_days=\[-1\] must be a list of day numbers"),
        ({"train_days": []}, r"train_days, val_days and test_days are all empty"),
        ({"train_days": [0], "table_sizes": [5, 5]}, r"table_sizes=\[5, 5\] must be an integer >= 1, or a list of 26"),
        ({"train_days": [0], "global_batch_size": 0}, r"global_batch_size=0 must be an integer >= 1"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            CriteoBinaryConfig(path=str(tmp_path), **kwargs)
    dm = CriteoBinaryDataModule(str(tmp_path), train_days=[3])
    with pytest.raises(FileNotFoundError, match=r"day_3_dense.npy does not exist: .*python -m lightning_recsys.data.criteo.to_npy"):
        dm.train_dataloader()
    with pytest.raises(ValueError, match="num_workers=-2 must be an integer >= 0"):
        CriteoBinaryDataModule(str(tmp_path), train_days=[0], num_workers=-2)


def test_datamodule_takes_rank_and_world_size_from_the_trainer(npy_dir):
    out, _, _ = npy_dir
    dm = CriteoBinaryDataModule(str(out), train_days=[0], table_sizes=SIZES, global_batch_size=10)
    whole = list(dm.train_dataloader())
    dm.trainer = SimpleNamespace(global_rank=1, world_size=2)
    (second,) = list(dm.train_dataloader())[:1]
    assert len(whole) == 2 and torch.equal(second.dense, whole[1].dense[:5])  # rank 1: rows 10..19, in batches of 5


def test_the_criteo_config_switches_to_npy_files_on_the_command_line(npy_dir):
    from pathlib import Path

    from lightning_recsys.cli import build_cli

    out, _, _ = npy_dir
    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "criteo_dlrm.yaml"
    cli = build_cli(
        ["--config", str(config), "--data", "lightning_recsys.data.CriteoBinaryDataModule", "--data.path", str(out),
         "--data.train_days", "[0, 1]", "--data.val_days", "[2]"],
        run=False,
    )
    dm = cli.datamodule
    assert isinstance(dm, CriteoBinaryDataModule) and dm.config.train_days == [0, 1] and dm.config.val_days == [2]
    assert dm.table_sizes == cli.model.hparams.table_sizes == [100000] * 26 and dm.config.global_batch_size == 2048
    assert cli.model.hparams.feature_names == dm.feature_names


def test_an_empty_day_between_days_is_an_empty_stretch_of_the_stream(npy_dir, tmp_path):
    """A day of 0 rows (an empty TSV converted, or every line skipped) adds nothing, on every rank."""
    out, _, _ = npy_dir
    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    for day in (5, 6):  # two empty days: one between days, one at the end (a day may be listed once)
        assert convert_tsv_to_npy(str(empty), str(out), day, progress=False) == 0
    config = CriteoBinaryConfig(path=str(out), train_days=[0, 5, 1, 6], table_sizes=SIZES, global_batch_size=8)
    expected = list(CriteoBinaryDataset(CriteoBinaryConfig(path=str(out), train_days=[0, 1], table_sizes=SIZES, global_batch_size=4), "train"))
    for world_size in (1, 2):
        for rank in range(world_size):
            batches = list(CriteoBinaryDataset(config, "train", rank, world_size))
            assert len(batches) == (23 + 17) // 8
            # Rank r of 2 holds rows [r*20, (r+1)*20): the one-rank batches of 4 from r*5 on.
            own = expected[rank * 5 : (rank + 1) * 5] if world_size == 2 else None
            if own is not None:
                assert all(torch.equal(a.dense, b.dense) for a, b in zip(batches, own))


def test_converter_refuses_two_inputs_for_one_day(tmp_path):
    """Two inputs with one day number would overwrite each other's npy files; the second silently won."""
    for part in ("part1", "part2"):
        (tmp_path / f"train_day_1_{part}.tsv").write_text("1" + "\t" * 39 + "\n")
    with pytest.raises(SystemExit, match="day 1 twice"):
        main([str(tmp_path / "train_day_1_part1.tsv"), str(tmp_path / "train_day_1_part2.tsv"), "--out-dir", str(tmp_path / "o")])
    with pytest.raises(SystemExit, match="day 0 twice"):
        main([str(tmp_path / "train_day_1_part1.tsv"), str(tmp_path / "train_day_1_part2.tsv"), "--days", "0", "0", "--out-dir", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_converter_refuses_a_negative_day_number(tmp_path):
    """--days -1 wrote day_-1_*.npy, which no CriteoBinaryDataModule split (day numbers >= 0) can read."""
    (tmp_path / "a.tsv").write_text("1" + "\t" * 39 + "\n")
    with pytest.raises(SystemExit, match=r"--days -1: day numbers must be >= 0 \(got \[-1\]\)"):
        main([str(tmp_path / "a.tsv"), "--days", "-1", "--out-dir", str(tmp_path / "o"), "--no-progress"])
    assert not (tmp_path / "o").exists()


def test_converter_refuses_inputs_of_which_only_some_are_named_day_n(tmp_path):
    """day_3.gz next to holdout.tsv was written as day 0 (the 0, 1, ... numbering), over any day_0 files there."""
    for name in ("day_3.tsv", "holdout.tsv"):
        (tmp_path / name).write_text("1" + "\t" * 39 + "\n")
    with pytest.raises(SystemExit, match=r"holdout.tsv: no day_N in the name, while other inputs have one; .* --days"):
        main([str(tmp_path / "day_3.tsv"), str(tmp_path / "holdout.tsv"), "--out-dir", str(tmp_path / "o"), "--no-progress"])
    assert not (tmp_path / "o").exists()
    main([str(tmp_path / "day_3.tsv"), str(tmp_path / "holdout.tsv"), "--days", "3", "4", "--out-dir", str(tmp_path / "o"), "--no-progress"])
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == [f"day_{d}_{k}.npy" for d in (3, 4) for k in ("dense", "labels", "sparse")]


@pytest.mark.parametrize("crlf", [False, True])  # the pyarrow path and the exact line-by-line path
@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        (3, str(2**31), r"integer feature 2 \(field 4\) 2147483648 is outside int32"),
        (2, str(-(2**31) - 1), r"integer feature 1 \(field 3\) -2147483649 is outside int32"),
        (20, "f" * 16, r"categorical feature cat_6 \(field 21\) 'ffffffffffffffff' is outside int64"),
    ],
)
def test_converter_reports_values_the_npy_format_cannot_hold(tmp_path, crlf, field, value, problem):
    """tsv_to_npys stores int32 integers and int64 categoricals: a wider value wrapped around (NaN dense for the whole day)."""
    rows = [_fields(random.Random(i), i) for i in range(6)]
    rows[4][field] = value
    path = tmp_path / "day_0"
    path.write_bytes(("\r\n" if crlf else "\n").join("\t".join(f) for f in rows).encode() + b"\n")
    from lightning_recsys.data.readers import MalformedLineError

    with pytest.raises(MalformedLineError, match=rf"day_0, line 5: {problem}"):
        convert_tsv_to_npy(str(path), str(tmp_path / "out"), 0, progress=False)
    assert convert_tsv_to_npy(str(path), str(tmp_path / "skip"), 0, on_bad_line="skip", progress=False) == 5
    assert np.isfinite(np.load(day_file(tmp_path / "skip", 0, "dense"))).all()


def test_a_day_listed_twice_in_a_split_is_refused_and_a_shared_val_day_warned(tmp_path):
    """[0, 1, 0] read day 0 twice per epoch without a word; a val day that trains too makes val a training score."""
    with pytest.raises(ValueError, match=r"train_days=\[0, 1, 0\] lists day\(s\) 0 more than once"):
        CriteoBinaryConfig(path=str(tmp_path), train_days=[0, 1, 0])
    with pytest.warns(UserWarning, match=r"val_days and train_days share day\(s\) 1"):
        CriteoBinaryConfig(path=str(tmp_path), train_days=[0, 1], val_days=[1], test_days=[2])


def test_converter_refuses_a_missing_input_before_converting_any(tmp_path):
    """A misspelled last input was found only after every input before it was converted (hours on the
    24 days of Criteo-1TB), as a traceback of FileNotFoundError from inside the converter."""
    (tmp_path / "day_0.tsv").write_text("1" + "\t" * 39 + "\n")
    out = tmp_path / "o"
    for missing, what in ((tmp_path / "day_1.tvs", "does not exist"), (tmp_path, "is not a file")):
        with pytest.raises(SystemExit, match=rf"{missing}: the input {what}; .*fix the path") as caught:
            main([str(tmp_path / "day_0.tsv"), str(missing), "--days", "0", "1", "--out-dir", str(out), "--no-progress"])
        assert str(caught.value).count("\n") == 0
        assert not out.exists()  # nothing was converted
    with pytest.raises(FileNotFoundError, match=r"day_1\.tvs does not exist"):
        convert_tsv_to_npy(str(tmp_path / "day_1.tvs"), str(out), 1, progress=False)
    assert not out.exists()


def test_a_missing_day_of_any_split_the_stage_reads_is_refused_at_setup(npy_dir):
    """The val loader is made when validation first runs: with check_val_every_n_epoch=2 a missing val day
    was found after a whole training epoch. setup(stage), on every rank before anything is sharded, checks."""
    out, _, _ = npy_dir
    dm = CriteoBinaryDataModule(str(out), train_days=[0], val_days=[1, 7], test_days=[9], table_sizes=SIZES, global_batch_size=10)
    for stage in ("fit", "validate"):
        with pytest.raises(FileNotFoundError, match=r"val_days=\[1, 7\]\): .*day_7_dense.npy does not exist: .*criteo.to_npy"):
            dm.setup(stage)
    for stage in ("test", "predict"):
        with pytest.raises(FileNotFoundError, match=r"test_days=\[9\]\): .*day_9_dense.npy does not exist"):
            dm.setup(stage)
    CriteoBinaryDataModule(str(out), train_days=[0], val_days=[1], table_sizes=SIZES, global_batch_size=10).setup("fit")


@pytest.mark.parametrize("crlf", [False, True])  # the pyarrow path and the exact line-by-line path
@pytest.mark.parametrize("low", [-1, -(2**31)])
def test_converter_dense_shift_does_not_wrap_near_int32_limits(tmp_path, crlf, low):
    """``x - min + 2`` was computed in int32: with a day's minimum below 0 an integer near 2^31 - 1 wrapped
    to a negative (NaN dense), and a minimum of -2^31 made ``np.int32(min - 2)`` raise OverflowError."""
    rows = [_fields(random.Random(i), i) for i in range(6)]
    rows[1][3] = str(2**31 - 1)
    rows[2][5] = str(low)
    path = tmp_path / "day_0"
    path.write_bytes(("\r\n" if crlf else "\n").join("\t".join(f) for f in rows).encode() + b"\n")
    convert_tsv_to_npy(str(path), str(tmp_path / "out"), 0, progress=False)
    dense = np.load(day_file(tmp_path / "out", 0, "dense"))
    raw = np.array([[int(x or "0") for x in f[1:14]] for f in rows], dtype=np.int64)
    assert raw.min() == low
    expected = np.log((raw - low + 2).astype(np.float32), dtype=np.float32)  # float32 as tsv_to_npys' np.log
    assert np.isfinite(dense).all() and np.array_equal(dense, expected)


def test_ids_modulo_a_table_size_above_2_to_the_31(tmp_path):
    """A table of 2^31 + 5 rows: stored values up to 2^63 - 1 map to ``value % size`` without int32 wrapping."""
    values = [0, 2**31 + 4, 2**31 + 5, 2**31 + 6, 2**32 + 17, 2**63 - 1]
    rows = [_fields(random.Random(i), i) for i in range(len(values))]
    for row, value in zip(rows, values):
        row[14] = f"{value:x}"
    path = tmp_path / "day_0"
    path.write_text("".join("\t".join(f) + "\n" for f in rows))
    convert_tsv_to_npy(str(path), str(tmp_path), 0, progress=False)
    size = 2**31 + 5
    ds = CriteoBinaryDataset(
        CriteoBinaryConfig(path=str(tmp_path), train_days=[0], table_sizes=[size] + [97] * 25, global_batch_size=6), "train"
    )
    ids = next(iter(ds)).sparse["cat_0"].values()
    assert ids.dtype == torch.int64 and ids.tolist() == [v % size for v in values]
