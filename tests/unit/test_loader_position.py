"""A training loader's position survives a mid-epoch checkpoint: the resumed epoch goes on with its next batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torchrec import KeyedJaggedTensor

from lightning_recsys.data import RecBatch
from lightning_recsys.parallel.input.input_guard import CoordinatedBatches
from lightning_recsys.parallel.input.loader_position import LoaderPosition


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _batch(number: int, size: int = 2) -> RecBatch:
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.arange(size), lengths=torch.ones(size, dtype=torch.long))
    return RecBatch(dense=torch.full((size, 1), float(number)), sparse=sparse, labels=torch.zeros(size))


def _numbers(batches) -> list[int]:
    return [int(b.dense[0, 0]) for b in batches]


def _wrap(source: list[RecBatch], group, trained: list[int]) -> CoordinatedBatches:
    return CoordinatedBatches(
        source, group=group, validator=None, validate="off", equal_sizes_required=False, progress=lambda: (trained[0], False)
    )


def test_a_resumed_iteration_starts_after_the_last_trained_batch_skipped_steps_included(one_rank_group):
    # Batch 1 is empty: its step is skipped on every rank, so step 1 trains source batch 2.
    source = [_batch(0), _batch(1, size=0), _batch(2), _batch(3), _batch(4)]
    trained = [0]
    first = _wrap(source, one_rank_group, trained)
    iterator = iter(first)
    seen = [next(iterator), next(iterator), next(iterator)]  # fetched ahead of the steps, as loops do
    assert _numbers(seen) == [0, 2, 3]
    trained[0] = 2  # the steps of batches 0 and 2 ran; 3 was only fetched
    state = first.state_dict()
    assert state == {"trained_batches": 2, "source_batches": 3, "epoch_done": False}

    resumed = _wrap(source, one_rank_group, trained)
    resumed.load_state_dict(state)
    assert _numbers(resumed) == [3, 4]
    assert _numbers(resumed) == [0, 2, 3, 4]  # the next epoch starts from the beginning again


def test_an_epoch_that_ended_resumes_with_a_fresh_epoch(one_rank_group):
    source = [_batch(0), _batch(1)]
    trained = [0]
    first = _wrap(source, one_rank_group, trained)
    assert _numbers(first) == [0, 1]  # the iteration ran out
    trained[0] = 2
    assert first.state_dict()["epoch_done"] is True
    resumed = _wrap(source, one_rank_group, trained)
    resumed.load_state_dict(first.state_dict())
    assert _numbers(resumed) == [0, 1]


def test_a_save_right_after_resuming_a_finished_epoch_keeps_it_finished():
    # fit(ckpt_path=...) from an end-of-epoch checkpoint, already at max_steps/max_epochs: the loop restores
    # "3 steps ran in this epoch" and starts the loader, which hands on nothing; a save then raised
    # "the loop and the loader disagree" (trainer.save_checkpoint after such a fit).
    position = LoaderPosition(lambda: (3, True))
    position.load_state_dict({"trained_batches": 3, "source_batches": 3, "epoch_done": True})
    assert position.start() == (0, 0)  # a finished epoch resumes with a fresh one
    assert position.state_dict() == {"trained_batches": 3, "source_batches": 3, "epoch_done": True}


def test_a_loader_with_its_own_state_keeps_it(one_rank_group):
    class Stateful(list):
        loaded = None

        def state_dict(self):
            return {"mine": 1}

        def load_state_dict(self, state):
            self.loaded = state

    source = Stateful([_batch(0), _batch(1)])
    wrapped = _wrap(source, one_rank_group, [1])
    assert wrapped.state_dict() == {"mine": 1}
    wrapped.load_state_dict({"mine": 1})
    assert source.loaded == {"mine": 1} and _numbers(wrapped) == [0, 1]  # nothing dropped on top of its own resume


def test_position_errors_name_the_problem():
    position = LoaderPosition(lambda: (5, False))
    position.start()
    with pytest.raises(RuntimeError, match="5 steps ran in this epoch"):
        position.state_dict()
    with pytest.raises(ValueError, match="malformed"):
        position.load_state_dict({"trained_batches": -1, "source_batches": 0, "epoch_done": False})
    with pytest.raises(ValueError, match="missing: \\['epoch_done'\\]"):
        position.load_state_dict({"trained_batches": 1, "source_batches": 1})
    assert LoaderPosition(None).state_dict() == {}
    assert LoaderPosition(lambda: (0, False)).state_dict() == {}  # never iterated
