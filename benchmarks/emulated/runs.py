"""One training run on the emulated cluster: two ``torchrun`` launches of ``_bench_job.py``, and its result.

``run_job`` starts node 0's and node 1's launch in their namespaces, bounds them by ``--run-timeout``,
and returns rank 0's JSON with the TBF counters and the delay line's CPU time of the run added.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from emulated.configs import NODES, RANKS_PER_NODE, WORKLOADS, BenchConfig
from emulated.network import Environment, kill_pids, namespace_pids, tbf_counters

HERE = Path(__file__).resolve().parents[1]
JOB = HERE / "_bench_job.py"


def _cpu_times(pid: int) -> tuple[float, float]:
    """User and system CPU time of a process, from /proc (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc (0 when it is gone)."""
    return sum(_cpu_times(pid))


class _CpuSampler:
    """Samples the helpers' CPU times every ``period`` s (wall clock), to charge them to a time window.

    The delay line forwards start-up traffic too (2D broadcasts every shard across nodes once); a
    window from the job's first to last timed step leaves that out.
    """

    def __init__(self, pids: tuple[int, ...], period: float = 0.05) -> None:
        self.pids, self.period = pids, period
        self.samples: list[tuple[float, float, float]] = []  # (unix time, user s, system s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        if pids:
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            times = [_cpu_times(pid) for pid in self.pids]
            self.samples.append((time.time(), sum(u for u, _ in times), sum(s for _, s in times)))
            self._stop.wait(self.period)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def between(self, start: float, end: float) -> tuple[float, float] | None:
        """User and system CPU seconds spent between two unix times (linear between samples)."""
        if len(self.samples) < 2 or not self.samples[0][0] <= start < end <= self.samples[-1][0]:
            return None

        def at(t: float, k: int) -> float:
            for (t0, *a), (t1, *b) in zip(self.samples, self.samples[1:]):
                if t0 <= t <= t1:
                    return a[k] + (b[k] - a[k]) * ((t - t0) / (t1 - t0) if t1 > t0 else 0.0)
            return self.samples[-1][k + 1]

        return at(end, 0) - at(start, 0), at(end, 1) - at(start, 1)


def trace_dir(env: Environment, cfg: BenchConfig, args: argparse.Namespace) -> Path | None:
    """Where ``cfg``'s run in ``env`` writes its profiler traces: the ``--trace`` configuration on the shaped cluster only."""
    if getattr(args, "trace", None) != cfg.name or not env.shaped_links:
        return None
    return Path(args.trace_dir) / cfg.name


def strategy_arguments(cfg: BenchConfig) -> list[str]:
    """``cfg`` as the arguments of ``_bench_job.add_strategy_arguments`` (any job that builds its strategy with it)."""
    return [
        "--sharding-group-size", str(cfg.sharding_group_size), "--layout", cfg.layout,
        "--sync-every-n-steps", str(cfg.sync_every_n_steps), "--qcomms", cfg.qcomms,
        "--sync-rows", cfg.sync_rows, "--sync-overlap" if cfg.sync_overlap else "--no-sync-overlap",
        "--sync-precision", cfg.sync_precision, "--sync-exchange", cfg.sync_exchange,
        "--index-dedup" if cfg.index_dedup else "--no-index-dedup",
    ]  # fmt: skip


def job_arguments(env: Environment, cfg: BenchConfig, args: argparse.Namespace, out_json: Path) -> list[str]:
    """_bench_job.py's arguments for ``cfg`` in ``env``."""
    traces = trace_dir(env, cfg, args)
    return [
        "--out", str(out_json), "--devices", str(RANKS_PER_NODE), "--num-nodes", str(NODES),
        *WORKLOADS[args.workload].job_argv(args), *strategy_arguments(cfg),
        *(["--phase-times"] if args.phase_times else []),
        *(["--trace-dir", str(traces)] if traces is not None else []),
    ]  # fmt: skip


def run_job(
    env: Environment, cfg: BenchConfig, args: argparse.Namespace, *, port: int, out_json: Path, log_dir: Path, job: Path = JOB,
    job_args: list[str] | None = None,
) -> dict[str, Any]:
    """Two torchrun launches (node ranks 0 and 1) of ``job`` (default _bench_job.py, with ``job_arguments``) in ``env``;
    rank 0's JSON result, which ``job`` writes to ``out_json``."""
    job_args = job_arguments(env, cfg, args, out_json) if job_args is None else job_args
    out_json.unlink(missing_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    before = tbf_counters(env)
    helper_cpu = sum(_cpu_seconds(pid) for pid in env.helper_pids)
    sampler = _CpuSampler(env.helper_pids)
    started = time.monotonic()
    try:
        for node in range(NODES):
            environ = dict(os.environ, GLOO_SOCKET_IFNAME=env.ifnames[node], OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
            log_path = log_dir / f"{cfg.name}.{'cluster' if env.shaped_links else 'reference'}.node{node}.log"
            log = open(log_path, "wb")  # noqa: SIM115 - closed in finally
            logs.append((log, log_path))
            cmd = [
                "ip", "netns", "exec", env.node_namespaces[node], sys.executable, "-m", "torch.distributed.run",
                "--nnodes", str(NODES), "--nproc-per-node", str(RANKS_PER_NODE), "--node-rank", str(node),
                "--master-addr", env.master_addr, "--master-port", str(port), "--max-restarts", "0",
                str(job), *job_args,
            ]  # fmt: skip
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=environ, cwd=HERE.parent, start_new_session=True))
        deadline = started + args.run_timeout
        for proc in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
    finally:
        timed_out = any(p.poll() is None for p in procs)
        sampler.stop()
        _stop(procs, env)
        for log, _ in logs:
            log.close()
    wall = time.monotonic() - started
    failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    if timed_out or failed or not out_json.exists():
        why = f"timed out after {args.run_timeout:.0f} s" if timed_out else f"exit codes {[p.returncode for p in procs]}"
        tails = "\n".join(f"--- {path} (last lines)\n" + _tail(path) for _, path in logs)
        raise RuntimeError(f"{cfg.name} on {env.name}: {why}\n{tails}")
    result = json.loads(out_json.read_text())
    result["wall_s"] = wall
    after = tbf_counters(env)
    result["tbf"] = {k: {m: after[k][m] - before.get(k, {}).get(m, 0) for m in after[k]} for k in after}
    if env.helper_pids:
        result["delay_line_cpu_s"] = sum(_cpu_seconds(pid) for pid in env.helper_pids) - helper_cpu
        window = result.get("timed_window_unix_s")
        timed = sampler.between(*window) if window else None
        if timed is not None:  # the timed steps only (1/CLK_TCK resolution, 10 ms here)
            result["delay_line_timed_cpu_s"] = {"user": timed[0], "system": timed[1], "steps": args.steps}
    return result


def _stop(procs: list[subprocess.Popen[bytes]], env: Environment) -> None:
    """End both launches: SIGTERM to torchrun (it stops its workers), then SIGKILL whatever is left in the namespaces."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    for ns in sorted(set(env.node_namespaces)):
        kill_pids(namespace_pids(ns))  # workers run in their own sessions; they are ours and in our namespace


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(unreadable: {exc})"


def combine_repeats(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from repeats: the fastest repeat's step time (other work on a shared machine only ever
    adds time); bytes and the rest from the first repeat (they do not vary)."""
    combined = dict(results[0])
    times = [r["step_time_s"] for r in results]
    combined["step_time_s"] = min(times)
    combined["examples_per_s"] = combined["config"]["global_batch_size"] / combined["step_time_s"]
    combined["repeats_step_time_s"] = times
    return combined


def print_run(cfg: BenchConfig, env: Environment, result: dict[str, Any]) -> None:
    """One line per run (and, with --phase-times, rank 0's phases)."""
    print(
        f"  {cfg.name:24s} {env.name:22s} step {result['step_time_s'] * 1e3:7.1f} ms  (run {result['wall_s']:.0f} s)",
        flush=True,
    )
    if "phase_ms_per_step" in result:
        phases = ", ".join(f"{k} {v:.1f}" for k, v in result["phase_ms_per_step"].items())
        print(f"  {'':24s} {'':22s} rank-0 ms per step: {phases}", flush=True)
    by_position = result.get("phase_ms_by_step_in_interval") or []
    if len(by_position) > 1:  # the sync's launch is the last position; its pieces go out at the others' ends
        line = "; ".join(f"{k} " + " / ".join(f"{p[k]:.1f}" for p in by_position) for k in ("forward", "backward", "sync_total"))
        print(f"  {'':24s} {'':22s} by step in the sync interval: {line}", flush=True)
