"""One harness for multi-process tests: gloo, a free port, bounded waits, no orphans; ranks start from a fork server."""

from __future__ import annotations

import io
import multiprocessing
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

import torch
import torch.multiprocessing as mp

# What every rank imports: the fork server imports it once, and each rank starts as a fork of it
# instead of a fresh interpreter that imports them again (measured: 24 s for these imports on 2 busy cores).
PRELOAD = ["torch", "torch.distributed", "torchrec", "torchrec.distributed", "lightning.pytorch", "lightning_recsys"]


def _context() -> Any:
    """A fork server that has imported PRELOAD, on CPU-only machines; spawn where CUDA is available
    (a fork of a process that loaded the CUDA libraries is not safe to use CUDA in), or where the
    environment says ``RECSYS_TEST_START_METHOD=spawn`` (every rank a fresh interpreter, as before)."""
    if torch.cuda.is_available() or os.environ.get("RECSYS_TEST_START_METHOD") == "spawn":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class _Inherit:
    """What a spawned rank inherits from the parent at start and a fork server's child does not: the
    environment of now (the server's is that of its own start) and stdout/stderr (pytest's capture of
    the running test). Pickled by ``Process.start``, the fds go to the child with its process object."""

    def __init__(self) -> None:
        self.env = dict(os.environ)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return _Inherited, (self.env, reduction.DupFd(1), reduction.DupFd(2))


class _Inherited:
    def __init__(self, env: dict[str, str], stdout: Any, stderr: Any) -> None:
        self.env, self.stdout, self.stderr = env, stdout.detach(), stderr.detach()

    def apply(self) -> None:
        os.environ.clear()
        os.environ.update(self.env)
        # A fork server's child inherits "forkserver" as its start method (multiprocessing.spawn.prepare sets it), so a
        # DataLoader's workers would start from a new, empty fork server (7 s each); a torchrun worker has the default.
        multiprocessing.set_start_method(None, force=True)
        for stream, fd in ((sys.stdout, self.stdout), (sys.stderr, self.stderr)):
            stream.flush()
            os.dup2(fd, stream.fileno())
            os.close(fd)


# "LOW-HIGH": where free_port draws ports from. tests/conftest.py sets a slice of 20000-32767 per pytest-xdist
# worker: below the kernel's ephemeral range (net.ipv4.ip_local_port_range, 32768-60999 by default), so neither
# another worker's bind(("", 0)) nor any outgoing connection's source port can take a port between our pick and
# the TCPStore's bind, as they could in the ephemeral range (seen as EADDRINUSE under parallel test workers).
PORT_RANGE_ENV = "RECSYS_TEST_PORTS"
_next_port: dict[tuple[int, int], int] = {}


def _parse_port_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    if not (low.isdigit() and high.isdigit() and 1024 <= int(low) < int(high) <= 65536):
        raise ValueError(f"{PORT_RANGE_ENV}={text!r}: expected LOW-HIGH with 1024 <= LOW < HIGH <= 65536, e.g. 20000-26000")
    return int(low), int(high)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on: from ``$RECSYS_TEST_PORTS`` (in turn, so two calls before
    either port is bound differ) when set, else one the kernel picks."""
    span = os.environ.get(PORT_RANGE_ENV)
    if not span:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    low, high = _parse_port_range(span)
    # A random start: a subprocess of a test draws from the same range as the test without repeating its first picks.
    cursor = _next_port.get((low, high), low + int.from_bytes(os.urandom(4), "little") % (high - low))
    for step in range(high - low):
        port = low + (cursor - low + step) % (high - low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _next_port[(low, high)] = port + 1 if port + 1 < high else low
        return port
    raise RuntimeError(f"no free port in {PORT_RANGE_ENV}={span}: every one is bound; widen the range or unset it")


def _rank_entry(
    fn: Callable[..., Any], rank: int, world_size: int, ranks_per_node: int, port: int, results: Any, args: tuple,
    inherited: _Inherited | None = None,
) -> None:
    if inherited is not None:
        inherited.apply()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank % ranks_per_node),
        LOCAL_WORLD_SIZE=str(ranks_per_node),
        NODE_RANK=str(rank // ranks_per_node),
    )
    try:
        # Bytes, not tensors: a tensor in a queue is shared through a file descriptor that dies with the rank.
        buffer = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
        raise SystemExit(1)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    ranks_per_node: int | None = None,
    grace_after_failure: float = 3.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; return results by rank.

    ``ranks_per_node`` emulates several nodes on this machine: NODE_RANK and LOCAL_RANK are set as
    a launcher would for ``world_size // ranks_per_node`` nodes (default: one node). After a first
    failure the others get ``grace_after_failure`` seconds to report before they are killed.

    Fails (never hangs) when a rank raises, dies, or the whole run exceeds ``timeout`` seconds; the
    error names the ranks. Every process is killed before this returns.
    """
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    per_node = ranks_per_node or world_size
    inherit = _Inherit() if ctx.get_start_method() == "forkserver" else None
    procs = [
        ctx.Process(target=_rank_entry, args=(fn, r, world_size, per_node, port, results, args, inherit)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    grace_until: float | None = None  # after a first failure, a moment to learn which ranks died
    try:
        while len(outputs) + len(failures) < world_size:
            now = time.monotonic()
            if (grace_until is not None and now > grace_until) or now > deadline:
                break
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in outputs and r not in failures and not p.is_alive() and p.exitcode != 0:
                        failures[r] = f"rank {r} died without a result (exit code {p.exitcode})"
                        grace_until = grace_until or time.monotonic() + grace_after_failure
                continue
            if status == "error":
                failures[rank] = f"rank {rank} failed:\n{value}"
                grace_until = grace_until or time.monotonic() + grace_after_failure
            else:
                outputs[rank] = torch.load(io.BytesIO(value), weights_only=False)
        if failures:
            raise AssertionError("\n".join(failures[r] for r in sorted(failures)))
        missing = sorted(set(range(world_size)) - set(outputs))
        if missing:
            raise AssertionError(f"rank(s) {missing} did not finish within {timeout:.0f}s")
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [outputs[r] for r in range(world_size)]


def run_processes(commands: list[list[str]], *, cwd: Any, envs: list[dict[str, str]] | None = None, timeout: float = 240) -> list[str]:
    """Run ``commands`` at once; return each one's output. Fails with the output tail of any that exits
    non-zero; none outlives this call."""
    import subprocess

    procs = [
        subprocess.Popen(command, cwd=cwd, env=envs[i] if envs else None, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i, command in enumerate(commands)
    ]
    try:
        outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for index, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"process {index} ({' '.join(commands[index][:4])} ...) exited {proc.returncode}:\n{output[-4000:]}"
    return outputs


def run_torchrun_nodes(script: list[str], *, nodes: int, nproc_per_node: int, cwd: Any, timeout: float = 240) -> list[str]:
    """Launch ``script`` as ``nodes`` torchrun launches on 127.0.0.1 (one per node rank); return each node's output."""
    import sys

    port = free_port()
    launches = [
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", str(nproc_per_node),
         "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), *script]
        for node in range(nodes)
    ]
    return run_processes(launches, cwd=cwd, timeout=timeout)
