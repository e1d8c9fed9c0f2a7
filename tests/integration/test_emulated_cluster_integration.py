"""benchmarks/emulated_cluster.py, very small: one configuration on a shaped 2-node namespace cluster.

Needs root, iproute2 and network namespaces; skips with the reason otherwise.
"""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lightning_recsys.testing.network_namespaces import namespace_skip_reason

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "emulated_cluster.py"


def _skip_reason() -> str | None:
    return namespace_skip_reason("create network namespaces and tc qdiscs")


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]


def _namespaces_of(pid: int) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True, timeout=20).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(f"lrsec{pid}-")]


def _processes_mentioning(text: str, but: int = -1) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != but:
            try:
                if text.encode() in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


def _run_benchmark(args: list[str], *, timeout: float) -> tuple[subprocess.Popen[str], str]:
    """Run emulated_cluster.py with ``args`` to the end (killed after ``timeout``); assert it exited 0."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        output = proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-4000:]
    return proc, output


def test_tiny_emulated_cluster_run_reports_and_cleans_up(tmp_path):
    out = tmp_path / "ec.json"
    proc, output = _run_benchmark(
        ["--configs", "2d_touched", "--warmup-steps", "2", "--steps", "3", "--global-batch-size", "512", "--table-rows", "64",
         "--bandwidth-mbit", "100", "--latency-ms", "1", "--run-timeout", "50", "--repeats", "1", "--json", str(out), "--no-png"],
        timeout=150,
    )  # fmt: skip
    assert "cluster step / best unshaped" in output and "Target: best 2D configuration" in output
    result = json.loads(out.read_text())
    assert result["shaping"]["bandwidth_mbit"] == 100
    (entry,) = result["configs"]
    assert entry["network_penalty"] > 0
    assert entry["vs_best_unshaped"] == entry["network_penalty"]  # one configuration: its own unshaped step is the best
    assert (entry["sync_rows"], entry["sync_every_n_steps"]) == ("touched", 1)
    sync = entry["sync_measured"]
    assert sync["syncs"] == 3 and 0 < sync["rows_per_sync"] <= sync["rows_total"]
    rows = entry["cluster"]["traffic_per_step_rank0"]
    # 2D all-to-all optimized: the embedding all-to-all stays inside the node, the replica sync crosses.
    assert all(r["inter_node_bytes"] == 0 for r in rows if r["purpose"] in ("embeddings", "sparse_ids"))
    assert any(r["purpose"] == "replica_sync" and r["inter_node_bytes"] > 0 for r in rows)
    assert sum(link["bytes"] for link in entry["cluster"]["tbf"].values()) > 0  # traffic went through the shaped links
    if result["shaping"]["delay_method"] == "tun":  # its CPU over the timed steps, apart from start-up
        timed = entry["cluster"]["delay_line_timed_cpu_s"]
        assert timed["steps"] == 3 and timed["user"] >= 0 and timed["system"] >= 0
        assert timed["user"] + timed["system"] <= entry["cluster"]["delay_line_cpu_s"] + 0.02
    assert not _namespaces_of(proc.pid)
    assert not _processes_mentioning(str(tmp_path))


def test_tiny_sequence_workload_run_predicts_measures_and_compares(tmp_path):
    # One deduped 1D configuration keeps this short; the 2D pick and the ratios are checked without root
    # (tests/unit/test_emulated_cluster_parts.py).
    out = tmp_path / "ec.json"
    proc, output = _run_benchmark(
        ["--workload", "sequence", "--configs", "1d_dedup_fp32", "--items", "2000", "--context-rows", "100,10",
         "--history-length", "8", "--global-batch-size", "64", "--warmup-steps", "2", "--steps", "2", "--run-timeout", "60",
         "--repeats", "1", "--json", str(out), "--no-png"],
        timeout=180,
    )  # fmt: skip
    assert output.index("Cost model, before the run") < output.index("1d_dedup_fp32 ") < output.index("Cost model vs measured")
    result = json.loads(out.read_text())
    assert result["model"]["workload"] == "sequence" and result["model"]["history_length"] == 8
    (entry,) = result["configs"]
    assert entry["index_dedup"] and 0 < entry["cluster"]["unique_id_fraction_rank0"]["item"] < 1
    embeddings = [r for r in entry["cluster"]["traffic_per_step_rank0"] if r["purpose"] == "embeddings"]
    assert sum(r["inter_node_bytes"] for r in embeddings) > 0  # 1D: the sequence all-to-all crosses the shaped link
    (compared,) = result["cost_model"]["per_config"]
    assert compared["config"] == "1d_dedup_fp32" and compared["predicted_s"] > compared["unshaped_s"] > 0
    assert result["cost_model"]["before"]["configs"]["1d_dedup_fp32"]["step_s"] > 0
    assert not _namespaces_of(proc.pid)


def test_sigterm_removes_namespaces_and_processes(tmp_path):
    out = tmp_path / "ec.json"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--configs", "1d_fp32", "--run-timeout", "60", "--json", str(out), "--no-png"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 40
        # Wait until the ranks are starting inside the node namespaces, then stop the benchmark.
        while time.monotonic() < deadline and not _processes_mentioning(str(tmp_path), but=proc.pid):
            time.sleep(0.2)
        assert _namespaces_of(proc.pid), "the benchmark made no namespaces"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert not _namespaces_of(proc.pid)
    time.sleep(0.5)
    assert not _processes_mentioning(str(tmp_path))
