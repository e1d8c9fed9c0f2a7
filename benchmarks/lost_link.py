"""Take the emulated cluster's inter-node link down mid-fit, then bring it back: do all ranks stop, and does the job come back?

    sudo python benchmarks/lost_link.py                 # 3 repeats, 2 nodes x 2 ranks (2D), timeout 20 s
    sudo python benchmarks/lost_link.py --repeats 5 --sharding-group-size 4   # 1D

Each repeat builds the emulated cluster of ``benchmarks/emulated_cluster.py`` (a network namespace
per node, a router namespace between them; no shaping beyond a 1 Gbit/s TBF) and runs
``benchmarks/restart_soak.py``'s job in it: two ``torchrun --max-restarts 1`` launches, a tiny DLRM,
``ModelCheckpoint(every_n_train_steps=3, save_last=True)`` and ``fit(ckpt_path="last")``, with
``process_group_timeout=--timeout``. After step ``--fault-at-step`` the router's side of both veths
goes down (packets are dropped, not refused). The driver watches the first attempt's four worker
processes and records when each exits, then brings the link back once all have (or after
``--link-down-s`` at the latest). The agents restart their workers, which resume from the newest
committed checkpoint, finish, and fit again without a fault in the same processes (the reference):
rank 0 compares batches, examples and weights.

Per repeat it prints each rank's seconds from the fault to its exit (the bound is timeout + 30 s),
whether every rank's log names the ranks it lost, and the time lost: from the fault to the first
training step after the resume. Then the median and range over the repeats. Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import restart_soak  # a sibling: benchmarks/ is the script's folder (and on pytest's pythonpath)
from emulated.network import (
    Environment, SetupError, build_cluster, kill_pids, namespace_pids, preflight, remove_stale_namespaces, sandbox_guard, set_link,
)  # fmt: skip

NODES, RANKS_PER_NODE = 2, 2
PORT = 29500  # inside fresh namespaces: always free
LOST_LINE = re.compile(r"TwoDRecStrategy: rank (\d+): (.*)")


def _workers(work_dir: Path) -> dict[int, int]:
    """pid -> global rank of this job's worker processes (torchrun's agents carry the same arguments; they are left out)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if b"--job" not in argv or str(work_dir).encode() not in argv or b"torch.distributed.run" in argv:
                continue
            environ = dict(e.split(b"=", 1) for e in (proc / "environ").read_bytes().split(b"\0") if b"=" in e)
            found[int(proc.name)] = int(environ[b"RANK"])
        except (OSError, KeyError, ValueError):
            pass
    return found


def _attempt0_steps(progress: Path) -> int:
    lines = progress.read_text().split() if progress.exists() else []
    steps = [int(lines[i + 1]) for i in range(0, len(lines) - 2, 3) if lines[i] == "0"]
    return max(steps, default=0)


def lost_ranks_named(log_text: str) -> dict[int, str]:
    """Rank -> the strategy's diagnosis line (``TwoDRecStrategy: rank r: ...``) in the launches' output."""
    return {int(m.group(1)): m.group(2) for m in LOST_LINE.finditer(log_text)}


def run_once(
    work_dir: Path, *, timeout: float = 20.0, fault_at_step: int = 7, step_sleep: float = 0.4, sharding_group_size: int | None = None,
    link_down_s: float = 90.0, launch_timeout: float = 240.0,
) -> dict[str, Any]:
    """One job on a fresh emulated cluster with the link taken down after ``fault_at_step``; its record."""
    work_dir.mkdir(parents=True, exist_ok=True)
    progress = work_dir / "progress.txt"
    job = [
        restart_soak.__file__, "--job", "--work-dir", str(work_dir), "--nodes", str(NODES), "--nproc-per-node", str(RANKS_PER_NODE),
        "--epochs", "2", "--batches-per-epoch", "6", "--timeout", str(timeout),
        *(["--sharding-group-size", str(sharding_group_size)] if sharding_group_size else []),
    ]  # fmt: skip
    record: dict[str, Any] = {"timeout_s": timeout, "fault_at_step": fault_at_step}
    remove_stale_namespaces()
    with sandbox_guard() as sandbox:
        env, _ = build_cluster(sandbox, bandwidth_mbit=1000, latency_ms=0, mtu=1500, delay_method="none")
        procs, logs = [], []
        try:
            for node in range(NODES):
                environ = {
                    **os.environ, "GLOO_SOCKET_IFNAME": env.ifnames[node], "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    restart_soak.PLAN_ENV: "", restart_soak.KILL_RANK_ENV: "0", restart_soak.PROGRESS_ENV: str(progress),
                    restart_soak.STEP_SLEEP_ENV: str(step_sleep),
                }  # fmt: skip
                log = open(work_dir / f"node{node}.log", "wb")  # noqa: SIM115 - closed below
                logs.append(log)
                cmd = [
                    "ip", "netns", "exec", env.node_namespaces[node], sys.executable, "-m", "torch.distributed.run",
                    "--nnodes", str(NODES), "--nproc-per-node", str(RANKS_PER_NODE), "--node-rank", str(node),
                    "--master-addr", env.master_addr, "--master-port", str(PORT), "--max-restarts", "1", "--monitor-interval", "0.5", *job,
                ]  # fmt: skip
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=environ, cwd=work_dir, start_new_session=True))
            record.update(_fault_and_recover(env, procs, work_dir, progress, fault_at_step, link_down_s, launch_timeout))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            for ns in env.node_namespaces:
                kill_pids(namespace_pids(ns))
            for log in logs:
                log.close()
    output = "\n".join((work_dir / f"node{n}.log").read_text(errors="replace") for n in range(NODES))
    record["exit_codes"] = [p.returncode for p in procs]
    record["diagnosis"] = lost_ranks_named(output)
    result_file = work_dir / restart_soak.RESULT_FILE
    result = json.loads(result_file.read_text()) if result_file.exists() else None
    record["came_back"] = all(c == 0 for c in record["exit_codes"]) and result is not None and result["attempt"] == 1
    if result is not None:
        record["same_batches"] = result["faulted"]["batches"] == result["reference"]["batches"]
        record["examples"] = [result["faulted"]["examples"], result["reference"]["examples"]]
        record["weights_differ"] = result["weights_differ"]
        if "fault_at" in record and result["first_step_at"] is not None:
            record["time_lost_s"] = round(result["first_step_at"] - record["fault_at"], 1)
    resumed = re.findall(r"loaded the committed checkpoint \S*faulted/last\.ckpt.* at step (\d+)", output)
    record["resumed_at_steps"] = [int(s) for s in resumed]
    record["output"] = output
    return record


def _fault_and_recover(
    env: Environment, procs: list[subprocess.Popen[bytes]], work_dir: Path, progress: Path, fault_at_step: int, link_down_s: float,
    launch_timeout: float,
) -> dict[str, Any]:
    started = time.time()
    out: dict[str, Any] = {}
    while _attempt0_steps(progress) < fault_at_step:
        if time.time() - started > launch_timeout or any(p.poll() is not None for p in procs):
            raise RuntimeError(f"the job did not reach step {fault_at_step} (exit codes {[p.poll() for p in procs]}); see {work_dir}/node*.log")
        time.sleep(0.05)
    workers = _workers(work_dir)  # the first attempt's, all alive: rank 0 reported a step after they started
    set_link(env, up=False)
    out["fault_at"] = fault_at = time.time()
    out["steps_before_fault"] = _attempt0_steps(progress)
    exited: dict[int, float] = {}
    while len(exited) < len(workers) and time.time() - fault_at < link_down_s:
        alive = {pid for pid in workers if Path(f"/proc/{pid}").exists() and _not_zombie(pid)}
        for pid in set(workers) - alive - set(exited):
            exited[pid] = time.time()
        time.sleep(0.1)
    set_link(env, up=True)
    out["link_down_s"] = round(time.time() - fault_at, 1)
    out["rank_exit_s"] = {workers[pid]: round(exited[pid] - fault_at, 1) if pid in exited else None for pid in workers}
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, launch_timeout - (time.time() - started)))
        except subprocess.TimeoutExpired:
            out["launch_timed_out"] = True
    return out


def _not_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=20.0, help="process_group_timeout of the job, seconds")
    parser.add_argument("--fault-at-step", type=int, default=7, help="the link goes down after this step (of 12; checkpoints every 3)")
    parser.add_argument("--sharding-group-size", type=int, default=None, help="default: one group per node (2D); 4 for 1D")
    parser.add_argument("--json", default=None, help="write every repeat's record here")
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args(argv)
    try:
        preflight(0.0, "none")
    except SetupError as exc:
        print(f"lost_link: {exc}", file=sys.stderr)
        return 2
    root = Path(args.work_dir or tempfile.mkdtemp(prefix="lost_link-"))
    records, ok = [], 0
    for k in range(args.repeats):
        record = run_once(root / f"run{k}", timeout=args.timeout, fault_at_step=args.fault_at_step, sharding_group_size=args.sharding_group_size)
        exits = record.get("rank_exit_s", {})
        good = (
            record["came_back"] and record.get("same_batches") and not record.get("weights_differ", ["?"])
            and all(v is not None and v <= args.timeout + 30 for v in exits.values()) and len(record["diagnosis"]) == NODES * RANKS_PER_NODE
        )  # fmt: skip
        ok += bool(good)
        print(
            f"repeat {k + 1}/{args.repeats}: rank exits after the fault (s) {dict(sorted(exits.items()))}; came_back={record['came_back']} "
            f"resumed_at={record['resumed_at_steps']} examples={record.get('examples')} weights_equal={not record.get('weights_differ', ['?'])} "
            f"time_lost_s={record.get('time_lost_s')}",
            flush=True,
        )
        for rank, line in sorted(record["diagnosis"].items()):
            print(f"    rank {rank}: {line}", flush=True)
        if not good:
            print(record["output"][-4000:], flush=True)
        records.append({k: v for k, v in record.items() if k != "output"})
    lost = [r["time_lost_s"] for r in records if "time_lost_s" in r]
    print(f"\n{ok} of {args.repeats} repeats: every rank stopped within timeout + 30 s naming lost ranks, and the job came back equal")
    if lost:
        print(f"fault -> first step after resume: median {statistics.median(lost):.1f} s, min {min(lost):.1f} s, max {max(lost):.1f} s (n={len(lost)})")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2))
    return 0 if ok == args.repeats else 1


if __name__ == "__main__":
    sys.exit(main())
