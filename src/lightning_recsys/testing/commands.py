"""Commands as a user types them (the console script, ``python script.py``, ``python -m module``), run as forks
of the fork server that ``run_ranks`` uses, which has torch, TorchRec and Lightning imported already.

A fresh interpreter spends about 10 s of CPU importing them before the command's first line; a fork starts at
``main``. What runs from there is the command's own code: its parser, its ``__main__`` block, its exit code, its
output. What differs from a subprocess: the imports happened before ``sys.argv`` was set (no command here reads
it at import time), and a multi-rank command gets the environment torchrun gives its workers (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_*``), so Lightning sees its processes as created outside and starts none.
The console script's own launch of its ranks is covered by the tests that run ``make demo`` as a subprocess.
"""

from __future__ import annotations

import os
import runpy
import sys
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_recsys.testing.processes import run_ranks

# Set by run_ranks for every rank; a single-process command (one that may start ranks of its own) runs without them.
_DISTRIBUTED_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")
CONSOLE_SCRIPT = "lightning-recsys"


@dataclass(frozen=True)
class CommandResult:
    """One process's exit code, stdout and stderr (as ``subprocess.run(..., capture_output=True, text=True)``)."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


class CommandFailed(AssertionError):
    """A rank of a command exited non-zero; the message ends with its output."""


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    return code if isinstance(code, int) else 1  # SystemExit("message") prints the message and exits 1


def _run_argv(argv: Sequence[str]) -> int:
    """``argv`` as after ``python`` (``-m module ...``, ``script.py ...``) or the console script's name; its exit code."""
    try:
        if argv[0] == CONSOLE_SCRIPT:
            from lightning_recsys.cli.main import main  # noqa: PLC0415

            sys.argv = [str(Path(sys.executable).with_name(CONSOLE_SCRIPT)), *argv[1:]]
            main(list(argv[1:]))
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = str(Path(argv[0]).resolve())
            sys.argv = [argv[0], *argv[1:]]
            sys.path.insert(0, str(Path(script).parent))  # as `python script.py` does
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exited:
        if not isinstance(exited.code, (int, type(None))):
            print(exited.code, file=sys.stderr)
        return _exit_code(exited.code)
    except BaseException:  # noqa: BLE001 - printed as the interpreter would, then exit 1
        traceback.print_exc()
        return 1
    return 0


def _command_rank(
    rank: int, world_size: int, argv: Sequence[str], cwd: str, env: Mapping[str, str], output_dir: str, distributed: bool,
    check: bool,
) -> CommandResult:
    if not distributed:
        for name in _DISTRIBUTED_ENV:
            os.environ.pop(name, None)
    os.environ.update(env)
    os.chdir(cwd)
    paths = [Path(output_dir) / f"rank{rank}.{stream}" for stream in ("stdout", "stderr")]
    for fd, path in zip((1, 2), paths):
        (sys.stdout if fd == 1 else sys.stderr).flush()
        with open(path, "wb") as out:
            os.dup2(out.fileno(), fd)
    code = _run_argv(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    result = CommandResult(code, *(path.read_text(errors="replace") for path in paths))
    if code != 0 and check:
        raise CommandFailed(f"{' '.join(argv)} (rank {rank} of {world_size}) exited {code}:\n{result.output[-6000:]}")
    return result


def run_command(
    argv: Sequence[str], *, cwd: str | os.PathLike[str], world_size: int = 1, env: Mapping[str, str] | None = None,
    timeout: float = 240.0, ranks_per_node: int | None = None, check: bool = True,
) -> list[CommandResult]:
    """Run ``argv`` (``["lightning-recsys", "fit", ...]``, ``["-m", "module", ...]`` or ``["script.py", ...]``) in
    ``cwd`` as ``world_size`` ranks; return each rank's result. Fails with a rank's output when it exits non-zero.

    ``world_size=1`` runs one process without the distributed environment, as a user's shell would; more ranks
    get torchrun's (``ranks_per_node`` emulates nodes as in ``run_ranks``). ``env`` adds to the caller's environment.
    ``check=False`` returns a non-zero exit too (for a command expected to fail; a failing rank of several then
    leaves its peers to their own timeouts).
    """
    with tempfile.TemporaryDirectory(prefix="command-") as output_dir:
        try:
            return run_ranks(
                _command_rank, world_size, list(argv), str(cwd), dict(env or {}), output_dir, world_size > 1, check,
                timeout=timeout, ranks_per_node=ranks_per_node,
            )
        except AssertionError as error:
            outputs = sorted(Path(output_dir).glob("rank*.std*"))
            tails = "\n".join(f"--- {p.name} (tail) ---\n{p.read_text(errors='replace')[-3000:]}" for p in outputs)
            raise CommandFailed(f"{error}\n{tails}") from None


def run_output(argv: Sequence[str], **kwargs: Any) -> str:
    """``run_command``'s outputs, rank 0's first, as one text."""
    return "".join(result.output for result in run_command(argv, **kwargs))


def run_cli(args: Sequence[str], *, cwd: str | os.PathLike[str], world_size: int, timeout: float = 300.0, **kwargs: Any) -> str:
    """``lightning-recsys <args>`` as ``world_size`` ranks (the config's ``trainer.devices`` times its nodes); their
    output, rank 0's first."""
    return run_output([CONSOLE_SCRIPT, *args], cwd=cwd, world_size=world_size, timeout=timeout, **kwargs)
