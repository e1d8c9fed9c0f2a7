"""The input pipeline's pieces that need no process group: ordering, input identity, accounting."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torchrec import KeyedJaggedTensor

from lightning_recsys import TwoDRecStrategy
from lightning_recsys.parallel.comms.comm_accounting import CommAccountant, comm_for_batch, release_batch_comm
from lightning_recsys.parallel.input.input_pipeline import StartedBatch, _same_inputs, pipelined


class _FakePipeline:
    """Records the calls ``pipelined`` makes, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def start(self, batch: Any, *, account: bool = False, handshake_token: object = None) -> StartedBatch:
        self.calls.append(("start", batch))
        return StartedBatch(batch, None)

    def drop(self, started: StartedBatch) -> None:
        self.calls.append(("drop", started.batch))


def test_the_next_batch_starts_before_the_current_one_is_yielded() -> None:
    fake = _FakePipeline()
    seen = []
    for batch in pipelined(iter([(0, None), (1, None), (2, None)]), fake, account=lambda: True):  # type: ignore[arg-type]
        seen.append(batch)
        fake.calls.append(("step", batch))
    assert seen == [0, 1, 2]
    # A batch is read by the step that calls the model with it, whenever the loop fetched it.
    assert fake.calls[:6] == [("start", 0), ("start", 1), ("step", 0), ("start", 2), ("step", 1), ("step", 2)]


def test_an_error_about_the_next_batch_surfaces_after_the_current_step() -> None:
    def agreed():
        yield "a", None
        raise ValueError("batch 1 is invalid")

    fake = _FakePipeline()
    iterator = pipelined(agreed(), fake, account=lambda: True)  # type: ignore[arg-type]
    assert next(iterator) == "a"  # the step of batch 0 runs, as without the pipeline
    with pytest.raises(ValueError, match="batch 1 is invalid"):
        next(iterator)


def test_closing_early_finishes_the_started_batch_and_closes_the_source() -> None:
    closed = []

    def agreed():
        try:
            yield from ((i, None) for i in range(10))
        finally:
            closed.append(True)

    fake = _FakePipeline()
    iterator = pipelined(agreed(), fake, account=lambda: True)  # type: ignore[arg-type]
    assert [next(iterator), next(iterator)] == [0, 1]
    iterator.close()  # max_steps or limit_*_batches reached with batch 2 in flight
    # Every batch it started is offered for dropping (the pipeline ignores those a step has read).
    assert {batch for call, batch in fake.calls if call == "drop"} == {0, 1, 2} and closed == [True]


def test_batches_yielded_before_the_source_ends_stay_runnable() -> None:
    fake = _FakePipeline()
    assert list(pipelined(iter([(0, None), (1, None)]), fake, account=lambda: True)) == [0, 1]  # type: ignore[arg-type]
    assert ("drop", 1) not in fake.calls  # a loop that fetched batch 1 ahead still runs it


def _kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 2]))


def test_same_inputs_accepts_a_new_wrapper_of_the_same_tensors_only() -> None:
    kjt = _kjt()
    assert _same_inputs(([kjt], {}), ([kjt.to(torch.device("cpu"))], {}))  # what Lightning's batch transfer makes
    assert not _same_inputs(([kjt], {}), ([_kjt()], {}))  # equal values, other tensors: computed elsewhere
    other = KeyedJaggedTensor.from_lengths_sync(keys=["g"], values=kjt.values(), lengths=kjt.lengths())
    assert not _same_inputs(([kjt], {}), ([other], {}))


def test_held_batch_traffic_counts_for_the_step_that_releases_it() -> None:
    accountant = CommAccountant.__new__(CommAccountant)  # no process group: only the step bookkeeping
    CommAccountant.__init__(accountant, topology=None, sharding_group=None, replica_group=None)  # type: ignore[arg-type]
    accountant._describe = lambda group: ("world", (0,), False)  # type: ignore[method-assign]
    accountant.topology = type("T", (), {"spans_nodes": staticmethod(lambda ranks: False)})()
    from lightning_recsys.parallel.comms import comm_accounting

    comm_accounting._ACTIVE.append(accountant)
    try:
        token = object()
        with comm_for_batch(token):
            accountant.record("all_to_all", object(), torch.zeros(4, dtype=torch.int64))
        accountant.begin_step()
        accountant.end_step()
        assert accountant.last_step == {}  # not this step's batch
        release_batch_comm(token)
        accountant.begin_step()
        accountant.end_step()
        assert sum(t.payload_bytes for t in accountant.last_step.values()) == 32
    finally:
        comm_accounting._ACTIVE.remove(accountant)


def test_pipeline_argument_is_validated() -> None:
    with pytest.raises(ValueError, match=r"pipeline='fast' is not one of \['sparse_dist', 'off'\]"):
        TwoDRecStrategy(pipeline="fast")  # type: ignore[arg-type]
