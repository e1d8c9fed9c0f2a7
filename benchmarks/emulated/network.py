"""The emulated cluster's network: a namespace per node and a router between them, the shaped link, cleanup.

Each node's namespace reaches the other through a veth into the router namespace, shaped by a TBF
on the node's egress and delayed by netem or ``_delay_line.py``; ``Sandbox`` owns every namespace
and helper process of a run and removes them all.
"""

from __future__ import annotations

import argparse
import atexit
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from emulated.configs import NODES

DELAY_LINE = Path(__file__).resolve().parents[1] / "_delay_line.py"
NS_PREFIX = "lrsec"  # every namespace this benchmark makes starts with this, then the owner's pid
ADDR_PREFIX = "10.213"  # node k: 10.213.k.2/24, router side 10.213.k.1/24 (only inside our namespaces)
COMMAND_TIMEOUT_S = 20.0  # any single ip/tc command


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
    router_links: tuple[tuple[str, str], ...] = ()  # (namespace, interface): the router's side of each node's veth


def add_link_arguments(parser: argparse.ArgumentParser) -> None:
    """The shaped link between the two nodes (``build_cluster``'s settings)."""
    parser.add_argument("--bandwidth-mbit", type=float, default=200.0, help="rate of each node's uplink (each direction)")
    parser.add_argument("--latency-ms", type=float, default=1.0, help="one-way delay between nodes (RTT is twice this)")
    parser.add_argument(
        "--delay-method", default="auto", choices=["auto", "netem", "tun"], help="auto: netem if the kernel has it, else a TUN delay line"
    )
    parser.add_argument(
        "--mtu", type=int, default=65000, help="MTU of the node links (large packets keep the TUN delay line's CPU use low)"
    )


def run_command(cmd: Sequence[str], *, check: bool = True, timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(list(cmd), check=False, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise SetupError(f"`{' '.join(cmd)}` did not finish within {timeout:.0f} s") from exc
    if check and done.returncode != 0:
        raise SetupError(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    return done


def namespace_pids(namespace: str) -> list[int]:
    done = run_command(["ip", "netns", "pids", namespace], check=False)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def kill_pids(pids: list[int], sig: int = signal.SIGKILL) -> None:
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
        run_command(["ip", "netns", "add", name])
        self.namespaces.append(name)
        run_command(["ip", "-n", name, "link", "set", "lo", "up"])
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
            kill_pids(namespace_pids(namespace))
            run_command(["ip", "netns", "del", namespace], check=False)
        self.namespaces.clear()


def remove_stale_namespaces() -> list[str]:
    """Namespaces of earlier runs whose owning process is gone (killed with SIGKILL, power loss...)."""
    removed = []
    done = run_command(["ip", "netns", "list"], check=False)
    for line in done.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = re.fullmatch(rf"{NS_PREFIX}(\d+)-\w+", name)
        if match and int(match.group(1)) != os.getpid() and not _pid_alive(int(match.group(1))):
            kill_pids(namespace_pids(name))
            run_command(["ip", "netns", "del", name], check=False)
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
    run_command(["ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1",
          "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0"])  # fmt: skip
    nodes, ifnames, router_ifs = [], [], []
    for k in range(NODES):
        node = sandbox.namespace(f"n{k}")
        node_if, router_if = sandbox.ifname(f"n{k}"), sandbox.ifname(f"r{k}")
        run_command(["ip", "link", "add", node_if, "netns", node, "mtu", str(mtu), "type", "veth",
              "peer", "name", router_if, "netns", router, "mtu", str(mtu)])  # fmt: skip
        run_command(["ip", "-n", node, "addr", "add", f"{ADDR_PREFIX}.{k}.2/24", "dev", node_if])
        run_command(["ip", "-n", router, "addr", "add", f"{ADDR_PREFIX}.{k}.1/24", "dev", router_if])
        run_command(["ip", "-n", node, "link", "set", node_if, "up"])
        run_command(["ip", "-n", router, "link", "set", router_if, "up"])
        run_command(["ip", "-n", node, "route", "add", "default", "via", f"{ADDR_PREFIX}.{k}.1"])
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
            netem = run_command(["ip", "netns", "exec", node, "tc", "qdisc", "add", "dev", node_if, "root", "handle", "1:",
                          "netem", "delay", f"{latency_ms}ms", "limit", "100000"], check=method == "netem")  # fmt: skip
            if netem.returncode == 0:
                run_command(["ip", "netns", "exec", node, "tc", "qdisc", "add", "dev", node_if, "parent", "1:1", "handle", "10:", *tbf])
                method = "netem"
                continue
            method = "tun"  # no sch_netem in this kernel: delay in user space instead
        run_command(["ip", "netns", "exec", node, "tc", "qdisc", "add", "dev", node_if, "root", "handle", "1:", *tbf])
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
        router_links=tuple((router, router_if) for router_if in router_ifs),
    )
    shaping = Shaping(
        bandwidth_mbit=bandwidth_mbit, latency_ms=latency_ms if method != "none" else 0.0, mtu=mtu,
        delay_method=method, tbf_burst_bytes=burst, tbf_latency_ms=tbf_latency_ms,
    )  # fmt: skip
    _check_link(env, rate_bytes)
    return env, shaping


def set_link(env: Environment, *, up: bool) -> None:
    """Take the inter-node link down (or bring it back): the router's side of every node's veth.

    Down, each node's veth loses its carrier and its qdisc drops what is sent: peers see silence
    (TCP retransmits), not a refused connection, as with a pulled cable or a dead switch."""
    if not env.router_links:
        raise SetupError(f"{env.name} has no inter-node link to take down")
    for ns, ifname in env.router_links:
        run_command(["ip", "-n", ns, "link", "set", ifname, "up" if up else "down"])


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
    run_command(["ip", "-n", router, "link", "set", tun, "mtu", str(mtu), "up"])
    run_command(["ip", "netns", "exec", router, "sysctl", "-qw", f"net.ipv4.conf.{tun}.rp_filter=0"])
    # Packets coming in from a node go into the TUN device; when written back they arrive from the
    # TUN device, so the main table forwards them to the other node.
    for router_if in router_ifs:
        run_command(["ip", "-n", router, "rule", "add", "iif", router_if, "lookup", "100"])
    run_command(["ip", "-n", router, "route", "add", "default", "dev", tun, "table", "100"])
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
    done = run_command(["ip", "netns", "exec", env.node_namespaces[1], sys.executable, "-c", probe], check=False, timeout=30)
    if done.returncode != 0:
        raise SetupError(f"node 1 cannot reach node 0 at {env.master_addr} through the shaped link: {done.stderr.strip()}")


def build_reference(sandbox: Sandbox) -> Environment:
    ns = sandbox.namespace("ref")
    return Environment(name="reference (unshaped)", node_namespaces=(ns, ns), master_addr="127.0.0.1", ifnames=("lo", "lo"))


def tbf_counters(env: Environment) -> dict[str, dict[str, int]]:
    out = {}
    for ns, ifname in env.shaped_links:
        text = run_command(["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", ifname], check=False).stdout
        sent = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+)", text)
        if sent:
            out[f"{ns}/{ifname}"] = {"bytes": int(sent.group(1)), "packets": int(sent.group(2)), "dropped": int(sent.group(3))}
    return out
