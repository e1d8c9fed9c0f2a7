"""The pyarrow Criteo reader against the line-by-line one: same batches, same errors, and rank/worker slices."""

import gzip
import logging
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_recsys.data.criteo.tsv import CriteoConfig, CriteoDataModule, CriteoDataset
from lightning_recsys.data.criteo.arrow import CriteoArrowDataset
from lightning_recsys.data.criteo.ranges import LineIndex, count_byte, count_chunk_lines, file_chunks
from lightning_recsys.data.readers import MalformedLineError


def _line(rng: random.Random, i: int) -> str:
    """A valid line with a mix of missing, negative, large and odd-length values; its first integer is ``i``."""
    ints = [str(i)] + [rng.choice(["", "0", "-1", "-3", "7", "123456", "0042", str(rng.randrange(10**9))]) for _ in range(12)]
    cats = [
        rng.choice(["", f"{rng.randrange(2**32):08x}", f"{rng.randrange(2**32):08X}", "a", "0", f"{rng.randrange(2**60):x}"])
        for _ in range(26)
    ]
    return "\t".join([str(rng.randrange(2))] + ints + cats)


def _released_line(rng: random.Random, i: int) -> str:
    """A line as the released files write them (8-digit hex or empty): pyarrow's fixed-width path reads it."""
    ints = [str(i)] + [rng.choice(["", "0", "-1", "-3", "7", "0042", str(rng.randrange(10**12))]) for _ in range(12)]
    cats = [rng.choice(["", f"{rng.randrange(2**32):08x}", f"{rng.randrange(2**32):08X}", "00000000"]) for _ in range(26)]
    return "\t".join([str(rng.randrange(2))] + ints + cats)


def _lines(n: int, seed: int = 0, released: bool = False) -> list[str]:
    rng = random.Random(seed)
    return [(_released_line if released else _line)(rng, i) for i in range(n)]


@pytest.fixture
def fixed_width_only(monkeypatch):
    """Fail a test whose valid lines would leave the fixed-width path (the any-width path or the exact one)."""
    import lightning_recsys.data.criteo.arrow as arrow_module
    import lightning_recsys.data.criteo.parse as parse_module

    def refuse(*args, **kwargs):
        raise AssertionError("a window left the fixed-width path")

    monkeypatch.setattr(parse_module, "_any_width_columns", refuse)
    monkeypatch.setattr(arrow_module, "python_parse", refuse)


def _write(path, lines, compress=False, newline_at_end=True) -> str:
    text = "\n".join(lines) + ("\n" if newline_at_end else "")
    if compress:
        with gzip.open(path, "wb") as f:
            f.write(text.encode("utf-8", errors="surrogateescape"))
    else:
        path.write_bytes(text.encode("utf-8", errors="surrogateescape"))
    return str(path)


def _config(paths, **kwargs) -> CriteoConfig:
    kwargs = {"table_sizes": [97] * 13 + [1000003] * 13, "global_batch_size": 8, **kwargs}
    return CriteoConfig(train_paths=paths, **kwargs)


def _same(a, b) -> bool:
    return (
        torch.equal(a.dense, b.dense)
        and torch.equal(a.labels, b.labels)
        and a.sparse.keys() == b.sparse.keys()
        and torch.equal(a.sparse.values(), b.sparse.values())
        and torch.equal(a.sparse.lengths(), b.sparse.lengths())
        and torch.equal(a.sparse.offsets(), b.sparse.offsets())
        and a.sparse.length_per_key() == b.sparse.length_per_key()
    )


def _first_ints(batch) -> list[int]:
    return [round(v) for v in torch.expm1(batch.dense[:, 0].double()).tolist()]


@pytest.mark.parametrize("window_bytes", [64, 1000, 1 << 20])
@pytest.mark.parametrize("compress", [False, True])
def test_same_batches_as_the_line_by_line_reader(tmp_path, window_bytes, compress):
    lines = _lines(150)
    first = _write(tmp_path / "a", lines[:61], compress)
    second = _write(tmp_path / "b", lines[61:], compress, newline_at_end=False)
    config = _config([first, second])
    old = list(CriteoDataset(config, "train"))
    new = list(CriteoArrowDataset(config, "train", window_bytes=window_bytes))
    assert len(new) == len(old) == 150 // 8  # the partial tail is dropped; a batch spans the two files
    assert all(_same(a, b) for a, b in zip(old, new))
    assert new[7].sparse.values().dtype == torch.int64 and new[7].dense.dtype == torch.float32


@pytest.mark.parametrize("parse_threads", [1, 3])
@pytest.mark.parametrize("compress", [False, True])
def test_released_layout_takes_the_fixed_width_path_with_the_same_batches(tmp_path, fixed_width_only, compress, parse_threads):
    lines = _lines(230, seed=1, released=True)
    first = _write(tmp_path / "a", lines[:101], compress)
    second = _write(tmp_path / "b", lines[101:], compress, newline_at_end=False)
    config = _config([first, second])
    old = list(CriteoDataset(config, "train"))
    new = list(CriteoArrowDataset(config, "train", window_bytes=1500, parse_threads=parse_threads))
    assert len(new) == len(old) == 230 // 8 and all(_same(a, b) for a, b in zip(old, new))


def test_hex8_words_is_int_base_16():
    import numpy as np

    from lightning_recsys.data.criteo.parse import hex8_words

    rng = random.Random(3)
    texts = ["00000000", "ffffffff", "FFFFFFFF", "0000000a", "A0000000", "12345678", "9abcdefA", "deadBEEF"]
    texts += [f"{rng.randrange(2**32):08{rng.choice('xX')}}" for _ in range(500)]
    words = np.frombuffer("".join(texts).encode(), dtype="<u8").copy()
    words[3] = 0  # a missing value: pyarrow's zero-filled slot
    out, scratch = np.empty_like(words), np.empty_like(words)
    hex8_words(words, out, scratch)
    assert out.tolist() == [0 if i == 3 else int(t, 16) for i, t in enumerate(texts)]


def test_a_negative_zero_or_dash_in_a_categorical_leaves_the_fixed_width_path_correctly(tmp_path):
    """The fixed-width path's hex check counts "-" signs; "-0" (no sign in the value) must not fool it."""
    lines = _lines(40, seed=2, released=True)
    fields = lines[9].split("\t")
    fields[3] = "-0"
    lines[9] = "\t".join(fields)
    config = _config([_write(tmp_path / "z.tsv", lines)])
    old, new = list(CriteoDataset(config, "train")), list(CriteoArrowDataset(config, "train", window_bytes=4000))
    assert len(new) == len(old) == 5 and all(_same(a, b) for a, b in zip(old, new))


def test_values_outside_the_fast_path_still_match(tmp_path):
    """Hex longer than 16 digits, integers past int64, CRLF line ends: the exact path reads them the same."""
    lines = _lines(24)
    fields = lines[5].split("\t")
    fields[20] = "1" * 40  # 40 hex digits
    fields[4] = "9" * 25  # bigger than int64
    lines[5] = "\t".join(fields)
    path = tmp_path / "crlf.tsv"
    path.write_bytes(("\r\n".join(lines) + "\r\n").encode())
    config = _config([str(path)])
    old, new = list(CriteoDataset(config, "train")), list(CriteoArrowDataset(config, "train"))
    assert len(new) == len(old) == 3 and all(_same(a, b) for a, b in zip(old, new))


@pytest.mark.parametrize("newline_at_end", [True, False])
def test_crlf_line_ends_take_the_fixed_width_path_with_the_same_batches(tmp_path, fixed_width_only, newline_at_end):
    """Files written on Windows: the "\\r" before each newline is a line end, as for the line-by-line reader, not a slow window."""
    lines = _lines(100, seed=4, released=True)
    path = tmp_path / "crlf.tsv"
    path.write_bytes(("\r\n".join(lines) + ("\r\n" if newline_at_end else "")).encode())
    config = _config([str(path)])
    lf_config = _config([_write(tmp_path / "lf.tsv", lines)])
    new = list(CriteoArrowDataset(config, "train", window_bytes=1500, parse_threads=1))
    lf = list(CriteoArrowDataset(lf_config, "train", window_bytes=1500, parse_threads=1))
    assert len(new) == len(lf) == 100 // 8 and all(_same(a, b) for a, b in zip(new, lf))


_GOOD = "\t".join(["1"] + ["5"] * 13 + ["0000000a"] * 26)
_BAD = [
    _GOOD.rsplit("\t", 1)[0],  # 39 fields
    "2" + _GOOD[1:],  # label
    "01" + _GOOD[1:],  # a two-character label
    "\t" + _GOOD[2:],  # an empty label
    _GOOD.replace("\t5\t", "\t9.5\t", 1),
    _GOOD.replace("\t5\t", "\t+5\t", 1),
    _GOOD.replace("\t5\t", "\t 5\t", 1),
    _GOOD.replace("\t5\t", "\t-\t", 1),
    _GOOD.replace("\t5\t", "\t0x5\t", 1),
    _GOOD.replace("\t5\t", "\t5-\t", 1),
    _GOOD.replace("\t5\t", "\tff\t", 1),
    _GOOD.replace("0000000a", "-000000a", 1),
    _GOOD.replace("0000000a", "0x00000a", 1),
    _GOOD.replace("0000000a", "-a", 1),
    _GOOD.replace("0000000a", "0000\r00a", 1),
    _GOOD.replace("0000000a", "caf\u00e9", 1),
    _GOOD.replace("0000000a", "00\udcff0000a", 1),  # a byte that is not UTF-8
    _GOOD + "\t",  # 41 fields
    "",  # an empty line
    '"1"' + _GOOD[1:],  # quotes are not special
    _GOOD.replace("\t5\t", "\t1e3\t", 1),  # hex letters in an integer
    _GOOD.replace("0000000a", "000000-a", 1),  # 8 bytes with a dash: the fixed-width path's count check
    _GOOD.replace("0000000a", "0000000g", 1),
    _GOOD.replace("0000000a", "-", 1),
]


@pytest.mark.parametrize("bad", _BAD)
@pytest.mark.parametrize("compress", [False, True])
def test_malformed_line_error_is_the_line_by_line_readers(tmp_path, bad, compress):
    lines = [_GOOD] * 30 + [bad] + [_GOOD] * 9
    path = _write(tmp_path / "day_3.tsv", lines, compress)
    config = _config([path], global_batch_size=4)
    with pytest.raises(MalformedLineError) as old:
        list(CriteoDataset(config, "train"))
    with pytest.raises(MalformedLineError) as new:
        list(CriteoArrowDataset(config, "train", window_bytes=700))
    assert str(new.value) == str(old.value)
    assert new.value.line_number == 31 and new.value.path == path


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_malformed_line_is_reported_by_the_rank_and_worker_that_parse_it(tmp_path, num_workers):
    lines = _lines(96, seed=4, released=True)
    lines[70] = _BAD[1]  # rank 1's range is lines 48..95 (0-based), its batch 5 of 6
    plain = _write(tmp_path / "day_1.tsv", lines[:60])
    packed = _write(tmp_path / "day_2.gz", lines[60:], compress=True)
    config = _config([plain, packed], global_batch_size=8)
    index = LineIndex.build([plain, packed], chunk_bytes=1000)
    rank0 = CriteoArrowDataset(config, "train", 0, 2, line_index=index, window_bytes=900)
    assert len(list(DataLoader(rank0, batch_size=None, num_workers=num_workers))) == 12
    rank1 = CriteoArrowDataset(config, "train", 1, 2, line_index=index, window_bytes=900, parse_threads=3)
    got = []
    with pytest.raises(MalformedLineError, match=r"day_2.gz, line 11: label '2' \(field 1\) is not 0 or 1") as error:
        for batch in DataLoader(rank1, batch_size=None, num_workers=num_workers):
            got.append(batch)
    if num_workers == 0:
        assert error.value.line_number == 11 and error.value.path == packed
        # The batches before the bad line's window came out first, in order (parse threads keep it).
        expected = [list(range(48 + 4 * k, 52 + 4 * k)) for k in range(5)]
        assert 3 <= len(got) <= 5 and [_first_ints(b) for b in got] == expected[: len(got)]


def test_skip_counts_and_logs_like_the_line_by_line_reader_with_line_aligned_batches(tmp_path, caplog):
    lines = _lines(20)
    lines[2], lines[9], lines[10] = "junk", "2" + lines[9][1:], ""
    first = _write(tmp_path / "a.tsv", lines[:12])
    second = _write(tmp_path / "b.tsv", [*lines[12:], "x\ty"])
    config = _config([first, second], global_batch_size=4, on_bad_line="skip")
    with caplog.at_level(logging.WARNING, logger="lightning_recsys.data.readers"):
        dataset = CriteoArrowDataset(config, "train", window_bytes=300)
        batches = list(dataset)
    assert dataset.skipped_lines == 4
    warnings = [r.getMessage() for r in caplog.records if r.name == "lightning_recsys.data.readers"]
    assert len(warnings) == 2
    assert f"Skipped 3 malformed line(s) of {first}" in warnings[0] and "the first was line 3:" in warnings[0]
    assert f"Skipped 1 malformed line(s) of {second}" in warnings[1] and "line 9:" in warnings[1]
    # 21 lines: 5 batches of 4 lines; a batch is short by its skipped lines.
    assert [_first_ints(b) for b in batches] == [[0, 1, 3], [4, 5, 6, 7], [8, 11], [12, 13, 14, 15], [16, 17, 18, 19]]
    # The examples are the line-by-line reader's, in the same order.
    old = list(CriteoDataset(config, "train"))
    assert sum((_first_ints(b) for b in old), []) == sum((_first_ints(b) for b in batches), [])[:16]


def _examples(batches) -> list[int]:
    return sum((_first_ints(b) for b in batches), [])


@pytest.mark.parametrize("released", [False, True])
@pytest.mark.parametrize(("world_size", "num_workers"), [(1, 2), (2, 0), (2, 2), (3, 0), (4, 3)])
def test_ranks_and_workers_cover_every_example_once(tmp_path, world_size, num_workers, released):
    lines = _lines(301, released=released)
    paths = [
        _write(tmp_path / "a.tsv", lines[:100]),
        _write(tmp_path / "b.gz", lines[100:170], compress=True),
        _write(tmp_path / "empty.tsv", [], newline_at_end=False),
        _write(tmp_path / "c.tsv", lines[170:], newline_at_end=False),
    ]
    config = _config(paths, global_batch_size=12)
    index = LineIndex.build(paths, chunk_bytes=997)  # many chunks: ranks start mid-chunk
    assert index.total == 301
    per_rank = []
    for rank in range(world_size):
        dataset = CriteoArrowDataset(config, "train", rank, world_size, line_index=index, window_bytes=2000)
        loader = DataLoader(dataset, batch_size=None, num_workers=num_workers)
        batches = list(loader)
        assert len(batches) == 301 // 12 and all(b.batch_size == 12 // world_size for b in batches)
        per_rank.append(batches)
    # Rank r holds the contiguous lines [r*n*b, (r+1)*n*b); together: the first n*B lines, once each.
    union = sum((_examples(batches) for batches in per_rank), [])
    assert union == list(range(301 // 12 * 12))
    # Workers do not change what a rank gets, and every example is the line-by-line reader's.
    old = {tuple(_first_ints(b)): b for b in CriteoDataset(_config(paths, global_batch_size=12 // world_size), "train")}
    for batches in per_rank:
        for batch in batches:
            assert _same(batch, old[tuple(_first_ints(batch))])


def test_concatenated_gzip_members_are_one_file(tmp_path):
    lines = _lines(40)
    path = tmp_path / "two_members.gz"
    path.write_bytes(gzip.compress(("\n".join(lines[:17]) + "\n").encode()) + gzip.compress(("\n".join(lines[17:]) + "\n").encode()))
    config = _config([str(path)])
    assert LineIndex.build([str(path)]).total == 40
    assert all(_same(a, b) for a, b in zip(CriteoDataset(config, "train"), CriteoArrowDataset(config, "train", window_bytes=500)))
    assert len(list(CriteoArrowDataset(config, "train", 1, 2))) == 40 // 8


def test_one_rank_with_workers_gives_the_batches_in_order(tmp_path):
    path = _write(tmp_path / "d.gz", _lines(90), compress=True)
    config = _config([path], global_batch_size=4)
    expected = list(CriteoDataset(config, "train"))
    got = list(DataLoader(CriteoArrowDataset(config, "train", window_bytes=900), batch_size=None, num_workers=2))
    assert len(got) == len(expected) == 22 and all(_same(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("newline_at_end", [True, False])
def test_line_index_counts_line_starts_at_every_chunk_size(tmp_path, newline_at_end):
    lines = ["a", "", "bcd", "ef", "", "", "ghijk"]
    path = _write(tmp_path / "x.tsv", lines, newline_at_end=newline_at_end)
    data = (tmp_path / "x.tsv").read_bytes()
    starts = [0] + [i + 1 for i, c in enumerate(data) if c == 10 and i + 1 < len(data)]
    for chunk_bytes in range(1, len(data) + 2):
        chunks = file_chunks([path], chunk_bytes)
        counted = [count_chunk_lines(c) for c in chunks]
        assert sum(c for c, _ in counted) == len(lines)
        for chunk, (count, first) in zip(chunks, counted):
            mine = [s for s in starts if chunk.start <= s < chunk.stop]
            assert count == len(mine) and (first == mine[0] if mine else first == chunk.stop)
    index = LineIndex.build([path, path], chunk_bytes=3)
    assert index.total == 2 * len(lines)
    chunk, skip = index.locate(len(lines) + 2)
    assert index.chunks[chunk].path == path and index.first_line_numbers[chunk] + skip == 3
    with pytest.raises(IndexError):
        index.locate(index.total)


def test_datamodule_defaults_to_arrow_and_gives_ranks_contiguous_lines(tmp_path):
    train = _write(tmp_path / "train.tsv", _lines(20))
    dm = CriteoDataModule([train], table_sizes=[97] * 13 + [1000003] * 13, global_batch_size=4, num_workers=0)
    assert dm.config.reader == "arrow"
    old = list(CriteoDataModule([train], table_sizes=dm.table_sizes, global_batch_size=4, reader="python").train_dataloader())
    assert all(_same(a, b) for a, b in zip(dm.train_dataloader(), old)) and len(old) == 5
    dm.trainer = SimpleNamespace(global_rank=1, world_size=2)
    assert [_first_ints(b) for b in dm.train_dataloader()] == [[10, 11], [12, 13], [14, 15], [16, 17], [18, 19]]
    assert dm.line_index("train").total == 20
    with pytest.raises(ValueError, match=r"reader='fast' is not one of \['arrow', 'python'\]"):
        CriteoDataModule([train], reader="fast")
    with pytest.raises(ValueError, match=r"num_workers=-1 must be an integer >= 0"):
        CriteoDataModule([train], num_workers=-1)


def test_prefetch_keeps_order_passes_errors_on_and_stops_when_closed():
    import threading

    from lightning_recsys.data.criteo.arrow import prefetch

    assert list(prefetch(iter(range(50)))) == list(range(50))

    def failing():
        yield 1
        raise OSError("disk gone")

    got = []
    with pytest.raises(OSError, match="disk gone"):
        for item in prefetch(failing()):
            got.append(item)
    assert got == [1]
    before = threading.active_count()
    stream = prefetch(iter(range(10**6)))
    assert next(stream) == 0
    stream.close()  # the producer sees the stop and ends; no thread is left behind
    assert threading.active_count() == before


def test_count_byte_equals_bytes_count():
    rng = np.random.default_rng(0)
    for data in (b"", b"\n", b"a\tb\n-1\n", rng.integers(0, 256, 100_003, dtype=np.uint8).tobytes()):
        for value in (10, 45, 0, 255):
            assert count_byte(data, value) == data.count(bytes([value])), (len(data), value)


@pytest.mark.parametrize("damage", ["truncated", "garbage after the end"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_a_damaged_gzip_file_is_named_in_the_error(tmp_path, damage, world_size):
    """A split of many day files: 'Truncated compressed stream' (pyarrow) or an EOFError (gzip) alone said not which."""
    lines = _lines(60)
    good = _write(tmp_path / "day_0.gz", lines[:30], compress=True)
    packed = gzip.compress(("\n".join(lines[30:]) + "\n").encode())
    bad = tmp_path / "day_1.gz"
    bad.write_bytes(packed[:-12] if damage == "truncated" else packed + b"junk")
    config = _config([good, str(bad)])
    readers = [lambda: CriteoArrowDataset(config, "train", 0, world_size)]
    if world_size == 1:
        readers.append(lambda: CriteoDataset(config, "train"))
    for reader in readers:
        with pytest.raises(OSError, match=rf"{bad}: the gzip data is damaged or truncated .*gzip -t"):
            list(reader())


@pytest.mark.parametrize("padding", [1, 512, 70_000])
def test_zero_padding_after_the_last_gzip_member_is_ignored_as_gzip_does(tmp_path, caplog, padding):
    """gzip -d and Python's gzip skip zero padding after the last member (tape blocks); pyarrow refused it and
    lost the output of the read that reached it."""
    lines = _lines(60)
    padded = tmp_path / "padded.gz"
    padded.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()) + b"\0" * padding)
    plain = _write(tmp_path / "plain.tsv", lines)
    assert LineIndex.build([str(padded)]).total == 60
    for world_size in (1, 2):  # 2: the rank's range is found by LineIndex, then read
        expected = list(CriteoArrowDataset(_config([plain]), "train", 0, world_size, window_bytes=500))
        with caplog.at_level(logging.INFO, logger="lightning_recsys.data.criteo.ranges"):
            got = list(CriteoArrowDataset(_config([str(padded)]), "train", 0, world_size, window_bytes=500))
        assert len(got) == len(expected) == 60 // 8
        assert all(_same(a, b) for a, b in zip(got, expected))
    assert "zero padding" in caplog.text and str(padded) in caplog.text
    expected = list(CriteoDataset(_config([plain]), "train"))
    assert all(_same(a, b) for a, b in zip(CriteoDataset(_config([str(padded)]), "train"), expected, strict=True))


def test_garbage_after_zero_padding_is_still_refused_naming_the_file(tmp_path):
    packed = gzip.compress(("\n".join(_lines(20)) + "\n").encode())
    bad = tmp_path / "day_0.gz"
    bad.write_bytes(packed + b"\0" * 512 + b"junk\0")  # ends in a zero byte, but is not only padding
    for reader in (lambda: CriteoArrowDataset(_config([str(bad)]), "train"), lambda: CriteoDataset(_config([str(bad)]), "train")):
        with pytest.raises(OSError, match=rf"{bad}: the gzip data is damaged or truncated .*gzip -t"):
            list(reader())
