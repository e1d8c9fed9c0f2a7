"""The emulated cluster's inter-node link goes down mid-fit: every rank stops in time naming the ranks it lost, and the job comes back.

benchmarks/lost_link.py's job (2 nodes x 2 ranks, 2D, two ``torchrun --max-restarts 1`` launches in
their network namespaces, checkpoints every 3 steps, ``fit(ckpt_path="last")``): the router's side of
both veths goes down after step 7 (packets dropped, not refused) and comes back once every worker of
the first attempt has exited. Needs root and iproute2; skips with the reason otherwise.
"""

from __future__ import annotations

import pytest
from lightning_recsys.testing.network_namespaces import namespace_skip_reason

TIMEOUT_S = 20.0  # process_group_timeout of the job


def _skip_reason() -> str | None:
    return namespace_skip_reason("create network namespaces and take their links down")


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]


def test_a_lost_link_stops_every_rank_naming_the_far_node_and_the_restart_resumes(tmp_path):
    import lost_link  # benchmarks/lost_link.py (imported here: the module is skipped without namespaces)

    record = lost_link.run_once(tmp_path, timeout=TIMEOUT_S, fault_at_step=7)
    output = record["output"]
    # Every rank of the first attempt exited on its own within process_group_timeout + 30 s of the fault.
    exits = record["rank_exit_s"]
    assert sorted(exits) == [0, 1, 2, 3], exits
    assert all(s is not None and s <= TIMEOUT_S + 30 for s in exits.values()), (exits, output[-6000:])
    # Each names the ranks across the link: node 0's the ranks that never checked in, node 1's those of the store's node.
    diagnosis = record["diagnosis"]
    for rank, far in ((0, "[2, 3]"), (1, "[2, 3]"), (2, "[0, 1]"), (3, "[0, 1]")):
        assert f"rank(s) {far}" in diagnosis.get(rank, ""), (rank, diagnosis)
        assert f"[rank{rank}]: TwoDRecStrategy: rank {rank}: " in output, f"rank {rank}'s raised error does not name them"
    # With the link back, the restarted workers resume from the last committed checkpoint (step 6) and finish.
    assert record["came_back"], (record["exit_codes"], output[-6000:])
    assert record["resumed_at_steps"] == [6], record["resumed_at_steps"]
    assert record["same_batches"], "a batch was trained twice or skipped"
    assert record["examples"][0] == record["examples"][1] == 12 * 32
    assert record["weights_differ"] == []
    print(f"lost link: rank exits after the fault {exits} s; time lost (fault -> first step after resume) {record['time_lost_s']} s")
