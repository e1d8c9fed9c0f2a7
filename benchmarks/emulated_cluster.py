"""Two "nodes" on one machine: network namespaces, a shaped link between them, and the step time on it.

    sudo python benchmarks/emulated_cluster.py --skip-unavailable    # every default configuration the install supports
    sudo python benchmarks/emulated_cluster.py --bandwidth-mbit 100 --latency-ms 2 --skip-unavailable
    sudo python benchmarks/emulated_cluster.py --configs 1d_fp32,2d_touched_sync4 --steps 16

Every configuration trains the same DLRM (synthetic click logs with Zipf ids, 8 tables of 10^5 to
10^6 rows built on meta, dim 16, table-wise sharding) with the same global batch on the same 4
processes: 2 nodes x 2 ranks, two ``torchrun --nnodes 2`` launches. The configurations: 1D (FP32,
FP8 QComms) and 2D all-to-all optimized with touched-row replica sync every 1 and 4 steps, blocking
or overlapped, fp32 or bf16 deltas (``ReplicaSyncConfig``); ``--skip-unavailable`` leaves out the
ones the installed version refuses. Each runs twice:

* **emulated cluster**: each node's ranks run in the node's own network namespace. Ranks of a node
  talk over the namespace's loopback (a connection to a local address never leaves the kernel), so
  intra-node traffic is unshaped. Traffic between nodes leaves through the node's veth, which is
  shaped with ``tc``: a TBF at ``--bandwidth-mbit`` on each node's egress, plus a fixed one-way
  ``--latency-ms`` delay (netem when the kernel has it, else ``_delay_line.py``, a TUN device in
  the router namespace that holds each packet for the delay)::

        node 0 ns                     router ns                       node 1 ns
      [r0 r1] lo       veth(tbf) <-> [ip_forward, delay] <-> veth(tbf)   [r2 r3] lo
      10.213.0.2                 10.213.0.1 | 10.213.1.1                 10.213.1.2

* **reference**: the same two launches in one namespace on its loopback, with no shaping. The
  strategy is told the same 2 nodes x 2 ranks, so its layout (groups, plan) is identical.

The headline is each configuration's step time on the emulated cluster divided by **one common
baseline**: the fastest unshaped step of any configuration (a configuration whose own unshaped step
is slow, e.g. from a CPU codec, gets no credit for it). Target: the best 2D configuration within
1.25x. Also reported: the step against the configuration's own unshaped step (the network penalty,
which the cost model validates), rank 0's rows and bytes per replica sync (``strategy.replica_sync_stats``)
and its bytes per step inside and across nodes from ``strategy.comm_accounting``. Prints a Markdown table, writes JSON
(default ``benchmarks/results/emulated_cluster.json``) and, when matplotlib is installed, a PNG.

Needs root, iproute2 (``ip``, ``tc``) and TBF in the kernel (and netem or /dev/net/tun for the
latency). It creates its namespaces (named ``lrsec<pid>-...``, addresses in 10.213.0.0/16 that
exist only inside them) and removes them, and every process it started in them, on exit, failure,
Ctrl-C or SIGTERM. Namespaces left by a run that was killed with SIGKILL are removed by the next run.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from _workload import add_workload_arguments, table_sizes, workload_argv

HERE = Path(__file__).resolve().parent
JOB = HERE / "_bench_job.py"
DELAY_LINE = HERE / "_delay_line.py"
RESULTS = HERE / "results"
NS_PREFIX = "lrsec"  # every namespace this benchmark makes starts with this, then the owner's pid
ADDR_PREFIX = "10.213"  # node k: 10.213.k.2/24, router side 10.213.k.1/24 (only inside our namespaces)
NODES, RANKS_PER_NODE = 2, 2
COMMAND_TIMEOUT_S = 20.0  # any single ip/tc command


@dataclass(frozen=True)
class BenchConfig:
    """One configuration of the strategy; everything else (model, data, processes) is shared."""

    name: str
    label: str
    sharding_group_size: int
    layout: str = "all_to_all_optimized"
    qcomms: str = "fp32"  # a _bench_job.py --qcomms choice
    sync_every_n_steps: int = 1
    sync_rows: str = "touched"  # ReplicaSyncConfig.rows
    sync_overlap: bool = False  # ReplicaSyncConfig.overlap
    sync_precision: str = "fp32"  # ReplicaSyncConfig.precision
    sync_exchange: str = "all_reduce"  # ReplicaSyncConfig.exchange

    @property
    def is_2d(self) -> bool:
        return self.sharding_group_size < NODES * RANKS_PER_NODE


def _touched(
    name: str, label: str, every: int, *, overlap: bool = False, precision: str = "fp32", exchange: str = "all_reduce"
) -> BenchConfig:
    return BenchConfig(
        name, label, sharding_group_size=2, sync_every_n_steps=every, sync_rows="touched", sync_overlap=overlap, sync_precision=precision,
        sync_exchange=exchange,
    )


CONFIGS: tuple[BenchConfig, ...] = (
    BenchConfig("1d_fp32", "1D FP32", sharding_group_size=4),
    BenchConfig("1d_fp8", "1D FP8", sharding_group_size=4, qcomms="fp8"),
    BenchConfig("2d_all_sync4", "2D whole-shard sync every 4", sharding_group_size=2, sync_every_n_steps=4, sync_rows="all"),
    _touched("2d_touched", "2D touched sync", 1),
    _touched("2d_touched_sync4", "2D touched sync every 4", 4),
    _touched("2d_touched_bf16", "2D touched sync, bf16 deltas", 1, precision="bf16"),
    _touched("2d_touched_bf16_sync4", "2D touched sync every 4, bf16 deltas", 4, precision="bf16"),
    _touched("2d_touched_overlap", "2D touched sync, overlapped", 1, overlap=True),
    _touched("2d_touched_overlap_sync4", "2D touched sync every 4, overlapped", 4, overlap=True),
    _touched("2d_touched_overlap_bf16", "2D touched sync, overlapped, bf16 deltas", 1, overlap=True, precision="bf16"),
    _touched("2d_touched_overlap_bf16_sync4", "2D touched sync every 4, overlapped, bf16 deltas", 4, overlap=True, precision="bf16"),
    # Each replica all-gathers its own touched rows' changes (no union agreement), bf16 or fp8 with a scale per row.
    _touched("2d_gather_overlap_bf16_sync4", "2D touched all-gather every 4, overlapped, bf16 deltas", 4, overlap=True,
             precision="bf16", exchange="all_gather"),
    _touched("2d_gather_overlap_fp8_sync4", "2D touched all-gather every 4, overlapped, fp8 deltas", 4, overlap=True,
             precision="fp8", exchange="all_gather"),
    # Every 16 kept quality on both quality benchmarks (docs/performance.md, Replica sync quality). Off by default: it needs --steps and
    # --warmup-steps that are multiples of 16 (e.g. 48 and 16), which doubles every run.
    _touched("2d_touched_overlap_bf16_sync16", "2D touched sync every 16, overlapped, bf16 deltas", 16, overlap=True, precision="bf16"),
    _touched("2d_gather_overlap_fp8_sync16", "2D touched all-gather every 16, overlapped, fp8 deltas", 16, overlap=True,
             precision="fp8", exchange="all_gather"),
    # 2D all-to-all optimized keeps the embedding all-to-all inside a node: QComms there only adds codec time.
    BenchConfig("2d_ar_touched", "2D all-reduce opt., touched sync", sharding_group_size=2, layout="all_reduce_optimized"),
)
# Not run by default: whole-shard sync of these tables moves ~100 MB per rank per sync (seconds at 200 Mbit/s);
# every 16 needs longer runs (above).
DEFAULT_OFF = ("2d_all_sync4", "2d_ar_touched", "2d_touched_overlap_bf16_sync16", "2d_gather_overlap_fp8_sync16")
TARGET, MOONSHOT = 1.25, 1.10  # best 2D cluster step / best unshaped step of any configuration


def unavailable_reason(cfg: BenchConfig) -> str | None:
    """Why the installed ReplicaSyncConfig refuses ``cfg``'s sync settings (None: it accepts them)."""
    from lightning_recsys import ReplicaSyncConfig

    try:
        ReplicaSyncConfig(rows=cfg.sync_rows, every_n_steps=cfg.sync_every_n_steps, overlap=cfg.sync_overlap, precision=cfg.sync_precision,  # type: ignore[arg-type]
                          exchange=cfg.sync_exchange)  # type: ignore[arg-type]
    except ValueError as exc:
        return str(exc)
    return None


class SetupError(RuntimeError):
    """The machine cannot host the emulated cluster (no root, no iproute2, no TBF...)."""


@dataclass(frozen=True, kw_only=True)
class Shaping:
    bandwidth_mbit: float
    latency_ms: float
    mtu: int
    delay_method: str  # resolved: "netem", "tun" or "none"
    tbf_burst_bytes: int
    tbf_latency_ms: float


@dataclass(frozen=True, kw_only=True)
class Environment:
    """Where the two torchrun launches run: a namespace per node, the master address, gloo's interface."""

    name: str
    node_namespaces: tuple[str, str]
    master_addr: str
    ifnames: tuple[str, str]
    shaped_links: tuple[tuple[str, str], ...] = ()  # (namespace, interface) with a TBF
    helper_pids: tuple[int, ...] = ()  # the delay line, whose CPU time is charged to each run


# --------------------------------------------------------------------------- commands and cleanup
def _run(cmd: Sequence[str], *, check: bool = True, timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(list(cmd), check=False, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise SetupError(f"`{' '.join(cmd)}` did not finish within {timeout:.0f} s") from exc
    if check and done.returncode != 0:
        raise SetupError(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    return done


def _ns_pids(namespace: str) -> list[int]:
    done = _run(["ip", "netns", "pids", namespace], check=False)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def _kill_pids(pids: list[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Sandbox:
    """Every namespace and helper process of this run; ``cleanup`` (idempotent) removes them all."""

    def __init__(self) -> None:
        self.tag = f"{NS_PREFIX}{os.getpid()}"
        self.namespaces: list[str] = []
        self.helpers: list[subprocess.Popen[str]] = []
        self._cleaned = False

    def namespace(self, suffix: str) -> str:
        name = f"{self.tag}-{suffix}"
        _run(["ip", "netns", "add", name])
        self.namespaces.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])
        return name

    def ifname(self, suffix: str) -> str:
        # Interface names are at most 15 characters; they only have to be unique inside a namespace.
        return f"lr{suffix}"[:15]

    def cleanup(self) -> None:
        if self._cleaned:
            return
        self._cleaned = True
        for helper in self.helpers:
            if helper.poll() is None:
                helper.terminate()
                try:
                    helper.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    helper.kill()
                    helper.wait(timeout=5)
        for namespace in reversed(self.namespaces):
            # Anything still running inside (a stuck rank) was started by us: kill it by pid.
            _kill_pids(_ns_pids(namespace))
            _run(["ip", "netns", "del", namespace], check=False)
        self.namespaces.clear()


def remove_stale_namespaces() -> list[str]:
    """Namespaces of earlier runs whose owning process is gone (killed with SIGKILL, power loss...)."""
    removed = []
    done = _run(["ip", "netns", "list"], check=False)
    for line in done.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = re.fullmatch(rf"{NS_PREFIX}(\d+)-\w+", name)
        if match and int(match.group(1)) != os.getpid() and not _pid_alive(int(match.group(1))):
            _kill_pids(_ns_pids(name))
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    return removed


@contextmanager
def sandbox_guard() -> Iterator[Sandbox]:
    """A Sandbox that is cleaned up on return, exception, Ctrl-C, SIGTERM/SIGHUP and interpreter exit."""
    sandbox = Sandbox()
    atexit.register(sandbox.cleanup)

    def on_signal(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally below

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    try:
        yield sandbox
    finally:
        # A second Ctrl-C must not interrupt the cleanup itself.
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        sandbox.cleanup()
        for s, handler in previous.items():
            signal.signal(s, handler)


# --------------------------------------------------------------------------- preflight and network
def preflight(latency_ms: float, delay_method: str) -> None:
    problems = []
    if platform.system() != "Linux":
        problems.append(f"network namespaces need Linux; this is {platform.system()}.")
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        problems.append("needs root to create network namespaces and tc qdiscs; run it as root (e.g. `sudo -E python ...`).")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        problems.append(f"needs iproute2 ({', '.join(missing)} not found on PATH); install it, e.g. `apt-get install iproute2`.")
    if latency_ms > 0 and delay_method == "tun" and not os.path.exists("/dev/net/tun"):
        problems.append("--delay-method tun needs /dev/net/tun.")
    if problems:
        raise SetupError(" ".join(problems))


def build_cluster(
    sandbox: Sandbox, *, bandwidth_mbit: float, latency_ms: float, mtu: int, delay_method: str
) -> tuple[Environment, Shaping]:
    """Router namespace + one namespace per node, veths, routes, TBF on each node's egress, the delay."""
    router = sandbox.namespace("r")
    _run(["ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1",
          "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0"])  # fmt: skip
    nodes, ifnames, router_ifs = [], [], []
    for k in range(NODES):
        node = sandbox.namespace(f"n{k}")
        node_if, router_if = sandbox.ifname(f"n{k}"), sandbox.ifname(f"r{k}")
        _run(["ip", "link", "add", node_if, "netns", node, "mtu", str(mtu), "type", "veth",
              "peer", "name", router_if, "netns", router, "mtu", str(mtu)])  # fmt: skip
        _run(["ip", "-n", node, "addr", "add", f"{ADDR_PREFIX}.{k}.2/24", "dev", node_if])
        _run(["ip", "-n", router, "addr", "add", f"{ADDR_PREFIX}.{k}.1/24", "dev", router_if])
        _run(["ip", "-n", node, "link", "set", node_if, "up"])
        _run(["ip", "-n", router, "link", "set", router_if, "up"])
        _run(["ip", "-n", node, "route", "add", "default", "via", f"{ADDR_PREFIX}.{k}.1"])
        nodes.append(node)
        ifnames.append(node_if)
        router_ifs.append(router_if)

    # TBF: a bucket of one packet (it must hold the largest packet; a larger bucket lets the start of
    # every collective through faster than the rate), and a deep queue so TCP is not dropped into
    # retransmission timeouts (the queue adds delay, not loss, as a switch buffer would).
    rate_bytes = bandwidth_mbit * 1e6 / 8
    burst = mtu + 1514
    tbf_latency_ms = 400.0
    method = delay_method
    if latency_ms <= 0:
        method = "none"
    for node, node_if in zip(nodes, ifnames):
        tbf = ["tbf", "rate", f"{bandwidth_mbit}mbit", "burst", str(burst), "latency", f"{tbf_latency_ms}ms"]
        if method in ("auto", "netem"):
            # netem delays, its child TBF limits the rate (tc-netem(8)'s recipe).
            netem = _run(["ip", "netns", "exec", node, "tc", "qdisc", "add", "dev", node_if, "root", "handle", "1:",
                          "netem", "delay", f"{latency_ms}ms", "limit", "100000"], check=method == "netem")  # fmt: skip
            if netem.returncode == 0:
                _run(["ip", "netns", "exec", node, "tc", "qdisc", "add", "dev", node_if, "parent", "1:1", "handle", "10:", *tbf])
                method = "netem"
                continue
            method = "tun"  # no sch_netem in this kernel: delay in user space instead
        _run(["ip", "netns", "exec", node, "tc", "qdisc", "add", "dev", node_if, "root", "handle", "1:", *tbf])
    helper_pids: tuple[int, ...] = ()
    if method == "tun":
        helper_pids = (_start_delay_line(sandbox, router, router_ifs, latency_ms, mtu),)
    env = Environment(
        name="emulated cluster",
        node_namespaces=(nodes[0], nodes[1]),
        master_addr=f"{ADDR_PREFIX}.0.2",
        ifnames=(ifnames[0], ifnames[1]),
        shaped_links=tuple(zip(nodes, ifnames)),
        helper_pids=helper_pids,
    )
    shaping = Shaping(
        bandwidth_mbit=bandwidth_mbit, latency_ms=latency_ms if method != "none" else 0.0, mtu=mtu,
        delay_method=method, tbf_burst_bytes=burst, tbf_latency_ms=tbf_latency_ms,
    )  # fmt: skip
    _check_link(env, rate_bytes)
    return env, shaping


def _start_delay_line(sandbox: Sandbox, router: str, router_ifs: list[str], latency_ms: float, mtu: int) -> int:
    if not os.path.exists("/dev/net/tun"):
        raise SetupError("the kernel has no netem and /dev/net/tun is missing, so no latency can be added; use --latency-ms 0.")
    tun = sandbox.ifname("dly")
    helper = subprocess.Popen(
        ["ip", "netns", "exec", router, sys.executable, str(DELAY_LINE), "--tun", tun, "--delay-ms", str(latency_ms)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    sandbox.helpers.append(helper)
    assert helper.stdout is not None
    line = helper.stdout.readline().strip()  # "ready", or the error it died with
    if line != "ready":
        raise SetupError(f"the delay line did not start: {line} {helper.stdout.read() if helper.poll() is not None else ''}")
    _run(["ip", "-n", router, "link", "set", tun, "mtu", str(mtu), "up"])
    _run(["ip", "netns", "exec", router, "sysctl", "-qw", f"net.ipv4.conf.{tun}.rp_filter=0"])
    # Packets coming in from a node go into the TUN device; when written back they arrive from the
    # TUN device, so the main table forwards them to the other node.
    for router_if in router_ifs:
        _run(["ip", "-n", router, "rule", "add", "iif", router_if, "lookup", "100"])
    _run(["ip", "-n", router, "route", "add", "default", "dev", tun, "table", "100"])
    return helper.pid  # `ip netns exec` execs python: the same process


def _check_link(env: Environment, rate_bytes: float) -> None:
    """Node 1 reaches node 0 (a connection through router, delay and TBF) within a few seconds."""
    probe = (
        "import socket,sys,time\n"
        "for _ in range(50):\n"
        "    try:\n"
        f"        socket.create_connection(('{env.master_addr}', 9), timeout=1).close(); break\n"
        "    except ConnectionRefusedError: break\n"  # refused = reached the other node's stack
        "    except OSError: time.sleep(0.1)\n"
        "else: sys.exit('unreachable')\n"
    )
    done = _run(["ip", "netns", "exec", env.node_namespaces[1], sys.executable, "-c", probe], check=False, timeout=30)
    if done.returncode != 0:
        raise SetupError(f"node 1 cannot reach node 0 at {env.master_addr} through the shaped link: {done.stderr.strip()}")


def build_reference(sandbox: Sandbox) -> Environment:
    ns = sandbox.namespace("ref")
    return Environment(name="reference (unshaped)", node_namespaces=(ns, ns), master_addr="127.0.0.1", ifnames=("lo", "lo"))


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


def _tbf_counters(env: Environment) -> dict[str, dict[str, int]]:
    out = {}
    for ns, ifname in env.shaped_links:
        text = _run(["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", ifname], check=False).stdout
        sent = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+)", text)
        if sent:
            out[f"{ns}/{ifname}"] = {"bytes": int(sent.group(1)), "packets": int(sent.group(2)), "dropped": int(sent.group(3))}
    return out


# --------------------------------------------------------------------------- one training run
def run_job(env: Environment, cfg: BenchConfig, args: argparse.Namespace, *, port: int, out_json: Path, log_dir: Path) -> dict[str, Any]:
    """Two torchrun launches (node ranks 0 and 1) of _bench_job.py in ``env``; rank 0's JSON result."""
    job_args = [
        "--out", str(out_json), "--devices", str(RANKS_PER_NODE), "--num-nodes", str(NODES),
        *workload_argv(args),
        "--sharding-group-size", str(cfg.sharding_group_size), "--layout", cfg.layout,
        "--sync-every-n-steps", str(cfg.sync_every_n_steps), "--qcomms", cfg.qcomms,
        "--sync-rows", cfg.sync_rows, "--sync-overlap" if cfg.sync_overlap else "--no-sync-overlap",
        "--sync-precision", cfg.sync_precision, "--sync-exchange", cfg.sync_exchange,
        *(["--phase-times"] if args.phase_times else []),
    ]  # fmt: skip
    out_json.unlink(missing_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    before = _tbf_counters(env)
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
                str(JOB), *job_args,
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
    after = _tbf_counters(env)
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
        _kill_pids(_ns_pids(ns))  # workers run in their own sessions; they are ours and in our namespace


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(unreadable: {exc})"


# --------------------------------------------------------------------------- report
def _combine(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from repeats: the fastest repeat's step time (other work on a shared machine only ever
    adds time); bytes and the rest from the first repeat (they do not vary)."""
    combined = dict(results[0])
    times = [r["step_time_s"] for r in results]
    combined["step_time_s"] = min(times)
    combined["examples_per_s"] = combined["config"]["global_batch_size"] / combined["step_time_s"]
    combined["repeats_step_time_s"] = times
    return combined


@dataclass
class Row:
    cfg: BenchConfig
    cluster: dict[str, Any] = field(default_factory=dict)
    reference: dict[str, Any] = field(default_factory=dict)

    @property
    def penalty(self) -> float:
        return self.cluster["step_time_s"] / self.reference["step_time_s"]


def inter_by_purpose(result: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in result["traffic_per_step_rank0"]:
        if r["inter_node_bytes"]:
            out[r["purpose"]] = out.get(r["purpose"], 0.0) + r["inter_node_bytes"]
    return out


def common_baseline(rows: list[Row]) -> tuple[str, float]:
    """The one baseline every configuration is measured against: the fastest unshaped step of any of them."""
    best = min(rows, key=lambda r: r.reference["step_time_s"])
    return best.cfg.name, best.reference["step_time_s"]


def sync_cells(result: dict[str, Any]) -> tuple[str, str]:
    sync = result.get("replica_sync")
    if not sync:
        return "-", "-"
    return f"{sync['rows_per_sync']:,.0f} ({sync['touched_fraction']:.2%})", f"{sync['payload_bytes_per_sync'] / 1e6:.2f}"


def markdown_table(rows: list[Row]) -> str:
    base_name, base = common_baseline(rows)
    head = (
        f"| configuration | group x replicas | step ms cluster | step ms unshaped | **cluster step / best unshaped ({base * 1e3:.0f} ms)** | "
        "own unshaped | rank-0 rows per sync (touched) | MB per sync | inter-node MB/step | inter-node MB by purpose |"
    )
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for row in rows:
        c, r, cfg = row.cluster, row.reference, row.cfg
        purposes = ", ".join(f"{k} {v / 1e6:.2f}" for k, v in sorted(inter_by_purpose(c).items()))
        rows_cell, mb_cell = sync_cells(c)
        lines.append(
            f"| {cfg.label} | {cfg.sharding_group_size} x {NODES * RANKS_PER_NODE // cfg.sharding_group_size} | "
            f"{c['step_time_s'] * 1e3:.0f} | {r['step_time_s'] * 1e3:.0f} | **{c['step_time_s'] / base:.2f}** | "
            f"{row.penalty:.2f} | {rows_cell} | {mb_cell} | {c['bytes_per_step_rank0']['inter_node'] / 1e6:.2f} | {purposes or '-'} |"
        )
    return "\n".join(lines)


def target_verdict(rows: list[Row]) -> dict[str, Any] | None:
    """The target: the best 2D configuration's cluster step <= 1.25x the best unshaped step (moonshot 1.10x)."""
    two_d = [r for r in rows if r.cfg.is_2d]
    if not two_d:
        return None
    base_name, base = common_baseline(rows)
    best = min(two_d, key=lambda r: r.cluster["step_time_s"])
    one_d = [r for r in rows if not r.cfg.is_2d]
    best_1d = min(one_d, key=lambda r: r.cluster["step_time_s"]) if one_d else None
    ratio = best.cluster["step_time_s"] / base
    return {
        "baseline_config": base_name, "baseline_step_s": base, "best_2d_config": best.cfg.name,
        "best_2d_cluster_step_s": best.cluster["step_time_s"], "ratio": ratio, "target": TARGET, "moonshot": MOONSHOT,
        "met": ratio <= TARGET, "moonshot_met": ratio <= MOONSHOT,
        "best_1d_config": best_1d.cfg.name if best_1d else None,
        "best_1d_ratio": best_1d.cluster["step_time_s"] / base if best_1d else None,
    }  # fmt: skip


def write_png(rows: list[Row], shaping: Shaping, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'lightning-recsys[bench]'); no PNG written."
    base_name, base = common_baseline(rows)
    ratios = [r.cluster["step_time_s"] / base for r in rows]
    labels = [textwrap.fill(r.cfg.label, 14) for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(16, 5.5))
    ax1.bar(range(len(rows)), ratios, color=["#b44" if not r.cfg.is_2d else "#48b" for r in rows])
    ax1.axhline(1.0, color="k", lw=1, ls="--", label=f"best unshaped step ({base_name}, {base * 1e3:.0f} ms)")
    ax1.axhline(TARGET, color="g", lw=1, ls=":", label=f"target {TARGET}x")
    for i, ratio in enumerate(ratios):
        ax1.text(i, ratio, f"{ratio:.2f}", ha="center", va="bottom", fontsize=9)
    ax1.set_xticks(range(len(rows)), labels, fontsize=7)
    ax1.set_ylabel("cluster step / best unshaped step")
    ax1.set_title("Step time on the emulated cluster, one common baseline (lower is better)")
    ax1.legend(fontsize=8)
    intra = [r.cluster["bytes_per_step_rank0"]["intra_node"] / 1e6 for r in rows]
    inter = [r.cluster["bytes_per_step_rank0"]["inter_node"] / 1e6 for r in rows]
    x = list(range(len(rows)))
    ax2.bar([i - 0.2 for i in x], intra, 0.4, label="intra-node")
    ax2.bar([i + 0.2 for i in x], inter, 0.4, label="inter-node")
    ax2.set_xticks(x, labels, fontsize=7)
    ax2.set_ylabel("MB per step (rank 0, comm accounting)")
    ax2.set_title("Bytes per step")
    ax2.legend()
    fig.suptitle(
        f"Emulated 2 nodes x 2 ranks on one machine: {shaping.bandwidth_mbit:g} Mbit/s, "
        f"{shaping.latency_ms:g} ms one-way between nodes ({shaping.delay_method} delay)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# --------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bandwidth-mbit", type=float, default=200.0, help="rate of each node's uplink (each direction)")
    parser.add_argument("--latency-ms", type=float, default=1.0, help="one-way delay between nodes (RTT is twice this)")
    parser.add_argument(
        "--delay-method", default="auto", choices=["auto", "netem", "tun"], help="auto: netem if the kernel has it, else a TUN delay line"
    )
    parser.add_argument(
        "--mtu", type=int, default=65000, help="MTU of the node links (large packets keep the TUN delay line's CPU use low)"
    )
    parser.add_argument(
        "--configs",
        default=",".join(c.name for c in CONFIGS if c.name not in DEFAULT_OFF),
        help="comma-separated subset of: " + ", ".join(c.name for c in CONFIGS) + f" (default: all but {', '.join(DEFAULT_OFF)})",
    )
    parser.add_argument(
        "--skip-unavailable",
        action="store_true",
        help="leave out configurations whose sync settings the installed ReplicaSyncConfig refuses (e.g. not implemented yet)",
    )
    add_workload_arguments(
        parser, table_rows="1000000,500000,200000,100000", steps_help="timed steps (a multiple of every config's sync interval)"
    )
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs of every (config, environment), in alternating order; the fastest is reported"
    )
    parser.add_argument("--run-timeout", type=float, default=240.0, help="seconds for one launch pair, start-up included")
    parser.add_argument(
        "--phase-times", action="store_true", help="also time each step's phases on rank 0 (_bench_job.py --phase-times), printed per run"
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "emulated_cluster.json")
    parser.add_argument("--png", type=Path, default=RESULTS / "emulated_cluster.png")
    parser.add_argument("--no-png", action="store_true")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = sorted(set(names) - {c.name for c in CONFIGS})
    if unknown or not names:
        parser.error(f"--configs={args.configs!r}: unknown {unknown}; choose from {[c.name for c in CONFIGS]}")
    args.selected = [c for c in CONFIGS if c.name in names]
    args.skipped = []
    refused = [(c, why) for c in args.selected if (why := unavailable_reason(c)) is not None]
    if refused and not args.skip_unavailable:
        parser.error(
            "the installed ReplicaSyncConfig refuses: "
            + "; ".join(f"{c.name} ({why})" for c, why in refused)
            + ". Pass --skip-unavailable to run the others, or leave these out of --configs."
        )
    args.skipped = [{"config": c.name, "reason": why} for c, why in refused]
    args.selected = [c for c in args.selected if all(c is not r for r, _ in refused)]
    if not args.selected:
        parser.error("no configuration left to run")
    try:
        table_sizes(args.table_rows, args.tables)
    except ValueError as exc:
        parser.error(str(exc))
    for cfg in args.selected:
        if args.steps % cfg.sync_every_n_steps or args.warmup_steps % cfg.sync_every_n_steps:
            parser.error(
                f"--steps={args.steps} and --warmup-steps={args.warmup_steps} must be multiples of {cfg.sync_every_n_steps} ({cfg.name})"
            )
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats} must be >= 1")
    if args.bandwidth_mbit <= 0 or args.latency_ms < 0:
        parser.error("--bandwidth-mbit must be > 0 and --latency-ms >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        preflight(args.latency_ms, args.delay_method)
    except SetupError as exc:
        print(f"emulated_cluster: cannot run here: {exc}", file=sys.stderr)
        return 2
    log_dir = args.json.parent / "emulated_cluster_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    load_before = os.getloadavg()
    rows: list[Row] = []
    errors: list[str] = []
    with sandbox_guard() as sandbox:
        stale = remove_stale_namespaces()
        if stale:
            print(f"removed namespaces left by earlier killed runs: {stale}")
        try:
            cluster, shaping = build_cluster(
                sandbox, bandwidth_mbit=args.bandwidth_mbit, latency_ms=args.latency_ms, mtu=args.mtu, delay_method=args.delay_method
            )
            reference = build_reference(sandbox)
        except SetupError as exc:
            print(f"emulated_cluster: cannot build the emulated network: {exc}", file=sys.stderr)
            return 2
        for skipped in args.skipped:
            print(f"skipped {skipped['config']}: {skipped['reason']}")
        print(
            f"Emulated cluster: {NODES} nodes x {RANKS_PER_NODE} ranks; between nodes {shaping.bandwidth_mbit:g} Mbit/s per "
            f"direction (TBF), {shaping.latency_ms:g} ms one-way ({shaping.delay_method}), MTU {shaping.mtu}; inside a node: loopback, unshaped.\n"
            f"Model: DLRM, {args.tables} tables x rows {table_sizes(args.table_rows, args.tables)} x dim {args.embedding_dim}, "
            f"table-wise, on meta; Zipf({args.zipf_exponent:g}) ids, pooling {args.pooling_factor:g}; "
            f"global batch {args.global_batch_size}; {args.warmup_steps} warm-up + {args.steps} timed steps per run.",
            flush=True,
        )
        port = 29610
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for repeat in range(args.repeats):
            for i, cfg in enumerate(args.selected):
                # Alternate the order so slow drift of a shared machine's load hits both sides alike.
                for env in (cluster, reference) if (i + repeat) % 2 == 0 else (reference, cluster):
                    port += 1
                    side = "cluster" if env is cluster else "reference"
                    try:
                        result = run_job(env, cfg, args, port=port, out_json=log_dir / f"{cfg.name}.{port}.json", log_dir=log_dir)
                    except RuntimeError as exc:
                        errors.append(str(exc))
                        print(f"FAILED {exc}", file=sys.stderr, flush=True)
                        continue
                    runs.setdefault((cfg.name, side), []).append(result)
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
        for cfg in args.selected:
            if (cfg.name, "cluster") in runs and (cfg.name, "reference") in runs:
                rows.append(Row(cfg, _combine(runs[(cfg.name, "cluster")]), _combine(runs[(cfg.name, "reference")])))
    elapsed = time.monotonic() - started

    if rows:
        print()
        print(markdown_table(rows))
        verdict = target_verdict(rows)
        if verdict is not None:
            print(
                f"\nTarget: best 2D configuration ({verdict['best_2d_config']}) cluster step = {verdict['ratio']:.2f}x the best "
                f"unshaped step ({verdict['baseline_config']}, {verdict['baseline_step_s'] * 1e3:.0f} ms); needs <= {TARGET}x: "
                f"{'MET' if verdict['met'] else 'MISSED'} (moonshot <= {MOONSHOT}x: {'MET' if verdict['moonshot_met'] else 'MISSED'})."
                + (f" Best 1D: {verdict['best_1d_config']}, {verdict['best_1d_ratio']:.2f}x." if verdict["best_1d_config"] else "")
            )
        drops = sum(d["dropped"] for r in rows for d in r.cluster.get("tbf", {}).values())
        if any("delay_line_cpu_s" in r.cluster for r in rows):
            per_step = {
                r.cfg.name: 1e3 * r.cluster["delay_line_cpu_s"] / (args.warmup_steps + args.steps + 1)
                for r in rows
                if "delay_line_cpu_s" in r.cluster
            }
            print("\nDelay line CPU per step (ms, start-up traffic included): " + ", ".join(f"{k} {v:.1f}" for k, v in per_step.items()))
        timed_cpu = {r.cfg.name: r.cluster["delay_line_timed_cpu_s"] for r in rows if "delay_line_timed_cpu_s" in r.cluster}
        if timed_cpu:
            print(
                "Delay line CPU per timed step (ms, user + system): "
                + ", ".join(f"{k} {1e3 * c['user'] / c['steps']:.1f} + {1e3 * c['system'] / c['steps']:.1f}" for k, c in timed_cpu.items())
            )
        print(
            f"\nTBF drops over all cluster runs: {drops}.  Total time {elapsed:.0f} s; load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}."
        )
        payload = {
            "shaping": asdict(shaping),
            "topology": {"nodes": NODES, "ranks_per_node": RANKS_PER_NODE},
            "model": {"tables": args.tables, "table_rows": table_sizes(args.table_rows, args.tables), "embedding_dim": args.embedding_dim,
                      "global_batch_size": args.global_batch_size, "pooling_factor": args.pooling_factor,
                      "zipf_exponent": args.zipf_exponent, "sharding_type": "table_wise"},
            "steps": {"warmup": args.warmup_steps, "timed": args.steps, "repeats": args.repeats},
            "machine": {"cpus": os.cpu_count(), "load_avg_before": load_before, "load_avg_after": os.getloadavg()},
            "elapsed_s": elapsed,
            "common_baseline": dict(zip(("config", "step_time_s"), common_baseline(rows))),
            "configs": [
                {**asdict(r.cfg), "vs_best_unshaped": r.cluster["step_time_s"] / common_baseline(rows)[1],
                 "network_penalty": r.penalty, "sync_measured": r.cluster.get("replica_sync"),
                 "cluster": r.cluster, "reference": r.reference} for r in rows
            ],
            "target": verdict,
            "skipped": args.skipped,
            "errors": errors,
        }  # fmt: skip
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.json}")
        if not args.no_png:
            problem = write_png(rows, shaping, args.png)
            print(problem or f"wrote {args.png}")
    if errors:
        print(f"{len(errors)} run(s) failed; see {log_dir}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
