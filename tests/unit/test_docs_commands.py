"""Every command the README and the docs/ pages show runs: each is checked in a fast form that fails where the real
one would.

* ``lightning-recsys fit|validate|test|predict ...`` and ``make demo ARGS="..."``: the CLI parses the
  config and options and builds every object (``run=False``), which rejects unknown options and values.
* ``python examples/<script>.py ...`` (also under ``torchrun``/``srun``): the script's own parser.
* ``python benchmarks/<script>.py`` and ``python -m <module> ...``: ``--help`` as its own process (it
  imports and parses; ``lightning_recsys.testing.commands``: a fork of the preloaded fork server).
* ``make <target>``: the Makefile has the target (``make -n``).
* ``lightning-recsys plan ...``: run for real (planning only), as its own process.
Package downloads and installs are not run (no network in tests); placeholders (``<cfg>``, ``$VAR``) neither.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from docs_text import PAGES, README, ROOT, fenced_blocks
from lightning_recsys.testing.commands import run_command

PREFIXES = ("make ", "lightning-recsys ", "python ", "python3 ", "torchrun ", "srun ")
DEMO_CONFIG = "examples/configs/synthetic_dlrm.yaml"  # what `make demo` runs (Makefile)


def documented_commands(pages: list[Path] = PAGES) -> list[str]:
    """The commands in ``pages``: inline code that starts with a command, and the lines of ```bash blocks."""
    commands = {m.group(1).strip() for page in pages for m in re.finditer(r"`((?:%s)[^`]*)`" % "|".join(PREFIXES), page.read_text())}
    for _, block in (b for b in fenced_blocks("bash") if b[0] in pages):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.split(r"\s#\s", line)[0].strip()
            if line.startswith(PREFIXES):
                commands.add(" ".join(line.split()))
    return sorted(c for c in commands if "<" not in c and "$" not in c and not c.startswith("python3 -m venv"))


def _cli_builds(args: list[str]) -> None:
    """``args`` as after ``lightning-recsys``: a subcommand, then options."""
    from lightning_recsys.cli import build_cli

    if "--print_config" in args:  # really run it: it prints the resolved config and exits 0
        with pytest.raises(SystemExit) as exited:
            build_cli(args)
        assert exited.value.code in (0, None)
        return
    assert args[0] in ("fit", "validate", "test", "predict"), args
    build_cli(args[1:], run=False)  # without run there is no subcommand


def _example_parses(script: str, args: list[str]) -> None:
    spec = importlib.util.spec_from_file_location("readme_example", ROOT / script)
    assert spec and spec.loader, script
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.parse_args(args)


@functools.lru_cache(maxsize=None)
def _help(args: tuple[str, ...]) -> tuple[int, str]:
    """``python <args> --help`` from the repository root: its exit code and output. Cached: the docs show some
    scripts several times with other options, and each of those commands is checked by the same ``--help`` run."""
    [result] = run_command([*args, "--help"], cwd=ROOT, timeout=120, check=False)
    return result.returncode, result.output


def _tiny_prepared(tmp_path: Path) -> Path:
    from lightning_recsys.cli import main

    text = tmp_path / "events.txt"
    text.write_text("".join(f"{user} {item}\n" for user in range(1, 9) for item in range(1, 13)))
    with pytest.raises(SystemExit) as exited:
        main(["prepare", "--input", str(text), "--input-format", "user-item-lines", "--output", str(tmp_path / "prepared")])
    assert exited.value.code in (0, None)
    return tmp_path / "prepared"


def check(command: str, tmp_path: Path) -> None:
    words = shlex.split(command)
    if words[0] in ("torchrun", "srun"):
        words = ["python", *[w for w in words[1:] if w.startswith("examples/") or not w.startswith("-")]][:1] + words[words.index(next(w for w in words if w.endswith(".py"))):]
    if words[0] == "make":
        target = words[1]
        assert subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True).returncode == 0, f"no make target {target!r}"
        if target == "demo":
            extra = next((shlex.split(w[5:]) for w in words if w.startswith("ARGS=")), [])
            _cli_builds(["fit", "--config", str(ROOT / DEMO_CONFIG), *extra])
        return
    if words[0] == "lightning-recsys" and words[1] == "plan":
        run_command(words, cwd=ROOT, timeout=300)
        return
    if words[0] == "lightning-recsys" and words[1] == "prepare":  # parsed, not run: it reads and writes data
        from lightning_recsys.cli.prepare import _parser

        _parser().parse_args(shlex.split(re.sub(r"\[[^\]]*\]", "", command))[2:])  # "[--flag N]": an optional part
        return
    if words[0] == "lightning-recsys":
        args = [str(ROOT / w) if w.startswith("examples/") else w for w in words[1:]]
        if any(a.endswith("parquet_pretrain.yaml") for a in args) and "--data.path" in args:
            # The model's sizes are linked from the prepared directory's metadata: give it a real one.
            args[args.index("--data.path") + 1] = str(_tiny_prepared(tmp_path))
        if "--summary-json" in args:
            args[args.index("--summary-json") + 1] = str(tmp_path / "run.json")
        _cli_builds(args)
        return
    if words[0].startswith("python") and words[1] == "-m":
        returncode, output = _help(("-m", words[2]))
        assert returncode == 0, output[-3000:]
        return
    script = next(w for w in words if w.endswith(".py"))
    if script.startswith("examples/"):
        _example_parses(script, words[words.index(script) + 1 :])
    elif script.startswith("benchmarks/"):
        returncode, output = _help((script,))
        assert returncode == 0, output[-3000:]
    else:
        assert script == "train.py", f"unknown command form in the docs: {command}"  # the quick start's own script


def test_the_readme_shows_the_two_commands():
    assert {"make demo", "make test"} <= set(documented_commands([README]))


@pytest.mark.parametrize("command", documented_commands())
def test_documented_command_runs(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check(command, tmp_path)
