"""report_lost_ranks when the rendezvous store goes silent (its node or the link to it lost): bounded, naming that node's ranks;
and when a rank left its own error there before it exited: named with it, without a wait.

The store's server runs in a child process that is then SIGSTOPped: connections stay open and
nothing answers, as across a link that drops packets.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_recsys.parallel.topology import report_lost_ranks, report_own_error

SERVER = (
    "import sys, time, datetime, torch.distributed as d\n"
    "s = d.TCPStore('127.0.0.1', 0, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)\n"
    "print(s.port, flush=True)\n"
    "time.sleep(300)\n"
)


@pytest.mark.timeout(60)  # the unbounded check-in this guards against blocks forever
def test_a_silent_store_is_reported_within_the_wait_naming_its_nodes_ranks():
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            assert "every rank is still alive" in report_lost_ranks(0, 1, wait_seconds=2.0)  # the store answers
            # Rank 1 of 2 never checks in; the launcher's SIGTERM (stop_early) ends the wait before its 30 s.
            began = time.monotonic()
            early = report_lost_ranks(0, 2, wait_seconds=30.0, stop_early=lambda: time.monotonic() - began > 0.5)
            assert time.monotonic() - began < 3.0
            assert early.startswith("lost rank(s) [1]: they did not check in by the time the launcher stopped this rank"), early
            os.kill(server.pid, signal.SIGSTOP)
            started = time.monotonic()
            report = report_lost_ranks(2, 4, wait_seconds=2.0, store_host_ranks=range(2))
            elapsed = time.monotonic() - started
        finally:
            os.kill(server.pid, signal.SIGKILL)  # also ends the check-in thread still waiting on it
            dist.destroy_process_group()
    finally:
        server.kill()
        server.wait()
    # Bounded by the wait, not by the store's 60 s timeout (nor forever: a read with no deadline).
    assert elapsed < 2.0 + 3.0, elapsed
    assert report.startswith("unreachable rank(s) [0, 1]: the rendezvous store on their node"), report


@pytest.mark.timeout(60)
def test_a_rank_that_left_its_own_error_is_named_with_it_and_not_waited_for():
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        report_own_error(1, ValueError("a bug in rank 1's step\nsecond line"))
        started = time.monotonic()
        only_failed = report_lost_ranks(0, 2, wait_seconds=20.0)
        assert time.monotonic() - started < 5.0  # not the 20 s wait for a check-in
        assert only_failed == (
            "rank(s) [1] stopped on their own error (rank 1: ValueError: a bug in rank 1's step); see their output for the traceback"
        ), only_failed
        both = report_lost_ranks(0, 3, wait_seconds=1.0)  # rank 2 neither checks in nor leaves an error
        assert both.startswith("rank(s) [1] stopped on their own error (rank 1: ValueError: a bug in rank 1's step)"), both
        assert "; lost rank(s) [2]: they did not check in within 1s of the failure" in both, both
    finally:
        dist.destroy_process_group()
