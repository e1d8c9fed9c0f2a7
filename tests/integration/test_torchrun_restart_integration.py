"""torchrun --max-restarts with a rank SIGKILLed mid-fit: every restart comes back and resumes exactly.

The jobs are benchmarks/restart_soak.py's (a tiny DLRM, ModelCheckpoint(every_n_train_steps=3,
save_last=True), fit(ckpt_path="last")); each job also fits without a fault in the same processes,
and the final models are compared: batches and examples trained, weights bit for bit.
"""

from __future__ import annotations

import re

import pytest
import restart_soak  # benchmarks/restart_soak.py


def _assert_resumed_exactly(record: dict, resumed_steps: list[int]) -> None:
    output = "\n".join(record["outputs"])
    assert record["came_back"] and record["killed"], f"exit codes {record['exit_codes']}:\n{output[-6000:]}"
    assert "connectFullMesh" not in output, output[-6000:]
    assert record["same_batches"], "a batch was trained twice or skipped"
    assert record["examples"][0] == record["examples"][1] > 0
    assert record["weights_differ"] == [], record["weights_differ"]
    # ckpt_path="last": one INFO line at the first start, then each resume names the committed checkpoint and step.
    assert output.count("fit starts fresh at step 0") >= 1
    assert "there is no last checkpoint available" not in output
    steps = [int(s) for s in re.findall(r"loaded the committed checkpoint \S*faulted/last\.ckpt.* at step (\d+)", output)]
    assert steps == resumed_steps, steps  # one resume per attempt after the first, in order


@pytest.mark.slow
def test_four_consecutive_kills_at_different_points_each_come_back(tmp_path):
    """One job of 12 steps, 1 node x 2 ranks in 2D (two replicas, overlapped replica sync), --max-restarts 4. Attempt a
    loses rank (1 + a) % 2: inside step 7 (after backward), inside the sync save of step 9 (so the resume is from step 6,
    the end of epoch 0, again), in the validation after step 10, and after step 11 with its overlapped replica sync in
    flight (both resumed mid-epoch from step 9)."""
    record = restart_soak.run_once(
        tmp_path, nodes=1, nproc_per_node=2, sharding_group_size=1, epochs=2, batches_per_epoch=6,
        plan="in_step:7,sync_save:9,validation:10,overlapped_sync:11",
    )
    _assert_resumed_exactly(record, resumed_steps=[6, 6, 9, 9])
    assert record["examples"][0] == 12 * 16
    assert "2 replicas x sharding groups of 1 ranks" in record["outputs"][0]


@pytest.mark.slow
def test_a_kill_during_an_async_save_on_two_nodes_2d_comes_back(tmp_path):
    """Two torchrun launches (2 nodes x 2 ranks, one sharding group per node); rank 1 (node 0's group writes the
    shards) dies inside the background write of step 9's async save: the resume is from step 6, committed when that
    save began; node 1's ranks fail on the lost peer and restart too."""
    record = restart_soak.run_once(tmp_path, nodes=2, nproc_per_node=2, kill_rank=1, plan="async_save:9")
    _assert_resumed_exactly(record, resumed_steps=[6])
    assert "2 replicas x sharding groups of 2 ranks" in record["outputs"][0]
