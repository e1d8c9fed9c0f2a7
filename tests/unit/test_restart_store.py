"""attempt_scoped_store: under torchrun's shared store, a restart attempt never reads the keys of an earlier one."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from lightning_recsys.testing.processes import free_port

from lightning_recsys.parallel.topology import attempt_scoped_store

TIMEOUT = timedelta(seconds=10)


def test_outside_torchrun_there_is_no_scoped_store(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert attempt_scoped_store("127.0.0.1", 1, rank=0, world_size=1, timeout=TIMEOUT) is None
    # torchrun without its shared store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): every start gets a fresh store
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert attempt_scoped_store("127.0.0.1", 1, rank=0, world_size=1, timeout=TIMEOUT) is None


def test_each_restart_attempt_sees_only_its_own_keys_on_the_agents_store(monkeypatch):
    port = free_port()
    agent_store = dist.TCPStore("127.0.0.1", port, None, is_master=True, timeout=TIMEOUT, multi_tenant=True, wait_for_workers=False)  # torchrun's agent
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = attempt_scoped_store("127.0.0.1", port, rank=0, world_size=2, timeout=TIMEOUT)
    first.set("rank_1_address", "the dead rank's old address")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    second = attempt_scoped_store("127.0.0.1", port, rank=0, world_size=2, timeout=TIMEOUT)
    assert not second.check(["rank_1_address"])  # unscoped, gloo's connectFullMesh read this stale key
    second.set("rank_1_address", "the new address")
    assert first.get("rank_1_address") == b"the dead rank's old address"
    assert agent_store.num_keys() >= 2
