"""Two torchrun launches (node_rank 0 and 1, 2 ranks each) on 127.0.0.1: real 2-node 2D training."""

from pathlib import Path

import pytest
from lightning_recsys.testing.processes import run_torchrun_nodes

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_node_torchrun_trains_2d_and_exits_cleanly(tmp_path):
    script = [str(ROOT / "examples" / "train_synthetic_dlrm.py"), "--tiny", "--devices", "2", "--num-nodes", "2", "--sharding-group-size", "2"]
    outputs = run_torchrun_nodes(script, nodes=2, nproc_per_node=2, cwd=tmp_path)
    assert "2D all_to_all_optimized: 2 replicas x sharding groups of 2 ranks; sharding groups [[0, 1], [2, 3]]" in outputs[0]
    assert "Validation after 1 epochs on 4 ranks: AUC=" in outputs[0]
    # The traffic table (rank 0, last step): the embedding all-to-all stayed inside node 0.
    rows = [line.split() for line in outputs[0].splitlines() if line.startswith(("embeddings ", "sparse_ids ", "replica_sync "))]
    embedding_rows = [r for r in rows if r[0] in ("embeddings", "sparse_ids")]
    assert {r[0] for r in embedding_rows} == {"embeddings", "sparse_ids"}, rows
    assert all(r[3] == "False" and r[-1] == "0" for r in embedding_rows), rows
    assert any(r[:2] == ["replica_sync", "all_reduce"] and r[3] == "True" and int(r[-1]) > 0 for r in rows), rows


@pytest.mark.slow
def test_slurm_environment_of_srun_forms_the_2x2_topology_and_trains_2d(tmp_path):
    """Four processes with the variables srun sets for 2 nodes x 2 tasks; Lightning's SLURMEnvironment reads them."""
    import os
    import sys

    from lightning_recsys.testing.processes import free_port, run_processes

    script = [sys.executable, str(ROOT / "examples" / "train_synthetic_dlrm.py"), "--tiny", "--devices", "2", "--num-nodes", "2"]
    port = str(free_port())
    envs = []
    for rank in range(4):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK"))}
        env.update(
            SLURM_JOB_ID="4242", SLURM_JOB_NAME="recsys-2d", SLURM_NTASKS="4", SLURM_NTASKS_PER_NODE="2",
            SLURM_NNODES="2", SLURM_NODELIST="node[01-02]", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % 2),
            SLURM_NODEID=str(rank // 2), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,  # one machine plays both nodes
        )
        envs.append(env)
    outputs = run_processes([script] * 4, cwd=tmp_path, envs=envs)
    assert "2D all_to_all_optimized: 2 replicas x sharding groups of 2 ranks; sharding groups [[0, 1], [2, 3]]" in outputs[0]
    assert "Validation after 1 epochs on 4 ranks: AUC=" in outputs[0]


EXIT_RUNS = 3


@pytest.mark.slow
def test_short_two_node_jobs_exit_cleanly_every_time(tmp_path):
    """A tiny fit as two torchrun launches (2 nodes x 1 rank), EXIT_RUNS times: every launch exits 0, no abort."""
    script = [str(ROOT / "examples" / "train_synthetic_dlrm.py"), "--tiny", "--devices", "1", "--num-nodes", "2"]
    for run in range(EXIT_RUNS):
        outputs = run_torchrun_nodes(script, nodes=2, nproc_per_node=1, cwd=tmp_path)  # asserts exit code 0
        for node, output in enumerate(outputs):
            assert "terminate called" not in output, f"run {run}, node {node}:\n{output[-3000:]}"
