"""``benchmarks/prepared_equivalence.py``: a prepared directory's evaluation examples equal its text file's, and a
difference is reported (exit 1)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("duckdb")

from lightning_recsys.cli import main as cli_main  # noqa: E402

import prepared_equivalence  # noqa: E402  (benchmarks/prepared_equivalence.py)


def _text(path: Path, extra: str = "") -> Path:
    # Users of 1 to 9 events with repeated items and ids that are not dense, in file (time) order.
    lines = [f"{user} {(user * 7 + step * 3) % 23 + 1}" for user in range(1, 31) for step in range(user % 9 + 1)]
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


def _prepare(text: Path, output: Path) -> Path:
    with pytest.raises(SystemExit) as exited:
        cli_main(["prepare", "--input", str(text), "--input-format", "user-item-lines", "--output", str(output)])
    assert exited.value.code in (0, None)
    return output


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_the_prepared_directory_gives_the_text_files_examples(tmp_path, capsys, world_size):
    text = _text(tmp_path / "seq.txt")
    prepared = _prepare(text, tmp_path / "prepared")
    code = prepared_equivalence.main(["--text", str(text), "--prepared", str(prepared), "--world-size", str(world_size),
                                "--max-length", "4", "--global-batch-size", "6"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count("identical") == 2


def test_a_difference_is_reported(tmp_path, capsys):
    prepared = _prepare(_text(tmp_path / "seq.txt"), tmp_path / "prepared")
    changed = _text(tmp_path / "changed.txt", extra="30 5\n")  # one more event for the last user
    code = prepared_equivalence.main(["--text", str(changed), "--prepared", str(prepared), "--max-length", "4", "--global-batch-size", "6"])
    assert code == 1
    assert "1 missing, 1 extra" in capsys.readouterr().out
