"""Two torchrun launches (node_rank 0 and 1) on 127.0.0.1: the multi-node path via TorchElasticEnvironment."""

import subprocess
import sys
from pathlib import Path

import pytest

from multiprocess import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_node_torchrun_trains_and_exits_cleanly(tmp_path):
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
                "--master-addr", "127.0.0.1", "--master-port", str(port),
                str(ROOT / "examples" / "train_synthetic_dlrm.py"), "--tiny", "--devices", "1", "--num-nodes", "2",
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
    assert "Validation after 1 epochs on 2 ranks: AUC=" in outputs[0]
