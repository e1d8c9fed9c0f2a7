"""Two torchrun launches (node_rank 0 and 1, 2 ranks each) on 127.0.0.1: real 2-node 2D training."""

import subprocess
import sys
from pathlib import Path

import pytest

from multiprocess import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_node_torchrun_trains_2d_and_exits_cleanly(tmp_path):
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node),
                "--master-addr", "127.0.0.1", "--master-port", str(port),
                str(ROOT / "examples" / "train_synthetic_dlrm.py"), "--tiny",
                "--devices", "2", "--num-nodes", "2", "--sharding-group-size", "2",
            ],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=240)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for node, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"node {node} exited {proc.returncode}:\n{output[-4000:]}"
    assert "2D all_to_all_optimized: 2 replicas x sharding groups of 2 ranks; sharding groups [[0, 1], [2, 3]]" in outputs[0]
    assert "Validation after 1 epochs on 4 ranks: AUC=" in outputs[0]
    # The traffic table (rank 0, last step): the embedding all-to-all stayed inside node 0.
    rows = [line.split() for line in outputs[0].splitlines() if line.startswith(("embeddings ", "sparse_ids ", "replica_sync "))]
    embedding_rows = [r for r in rows if r[0] in ("embeddings", "sparse_ids")]
    assert {r[0] for r in embedding_rows} == {"embeddings", "sparse_ids"}, rows
    assert all(r[3] == "False" and r[-1] == "0" for r in embedding_rows), rows
    assert any(r[:2] == ["replica_sync", "all_reduce"] and r[3] == "True" and int(r[-1]) > 0 for r in rows), rows
