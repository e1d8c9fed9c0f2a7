"""torchrun --max-restarts with a rank SIGKILLed mid-fit: every restart comes back and resumes exactly.

The jobs are benchmarks/restart_soak.py's (a tiny DLRM, ModelCheckpoint(every_n_train_steps=3,
save_last=True), fit(ckpt_path="last")); each job also fits without a fault in the same processes,
and the final models are compared: batches and examples trained, weights bit for bit.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("restart_soak", ROOT / "benchmarks" / "restart_soak.py")
restart_soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(restart_soak)


def _assert_resumed_exactly(record: dict, kills: int) -> None:
    output = "\n".join(record["outputs"])
    assert record["came_back"] and record["killed"], f"exit codes {record['exit_codes']}:\n{output[-6000:]}"
    assert "connectFullMesh" not in output, output[-6000:]
    assert record["same_batches"], "a batch was trained twice or skipped"
    assert record["examples"][0] == record["examples"][1] > 0
    assert record["weights_differ"] == [], record["weights_differ"]
    # ckpt_path="last": one INFO line at the first start, then each resume names the committed checkpoint and step.
    assert output.count("fit starts fresh at step 0") >= 1
    assert "there is no last checkpoint available" not in output
    steps = [int(s) for s in re.findall(r"loaded the committed checkpoint \S*last\.ckpt.* at step (\d+)", output)]
    assert sorted(set(steps)) == [6 + 3 * a for a in range(kills)], steps


@pytest.mark.slow
def test_three_consecutive_kills_on_one_node_each_come_back(tmp_path):
    """One job, --max-restarts 3: attempts 0, 1, 2 each lose a rank (1, 0, 1) after steps 7, 10, 13 of 18."""
    record = restart_soak.run_once(tmp_path, nodes=1, nproc_per_node=2, kills=3, kill_at_step=7, epochs=3, batches_per_epoch=6)
    _assert_resumed_exactly(record, kills=3)
    assert record["examples"][0] == 18 * 16


@pytest.mark.slow
def test_a_kill_on_two_nodes_2d_comes_back(tmp_path):
    """Two torchrun launches (2 nodes x 2 ranks, one sharding group per node); rank 3 (node 1) is killed after step 7."""
    record = restart_soak.run_once(tmp_path, nodes=2, nproc_per_node=2, kills=1, kill_rank=3, kill_at_step=7)
    _assert_resumed_exactly(record, kills=1)
    assert "2 replicas x sharding groups of 2 ranks" in record["outputs"][0]
