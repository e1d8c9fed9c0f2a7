"""The step-phase labels on a stand-in for a TorchRec sharded module: the ranges, and nothing else changes."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile
from torchrec.distributed.types import Awaitable, NoWait

from lightning_recsys.parallel import step_phases
from lightning_recsys.parallel.step_phases import (
    EMBEDDING_ALL_TO_ALL_BACKWARD,
    EMBEDDING_ALL_TO_ALL_FORWARD,
    INPUT_DIST,
    LOOKUP,
    STEP_PHASES,
    StepPhaseLabels,
    step_phase,
)


class _Dist(nn.Module):
    def forward(self, embeddings: Tensor) -> Awaitable[Tensor]:
        return NoWait(embeddings * 2.0)  # stands in for the all-to-all; its backward doubles the gradient


class _ShardedStandIn(nn.Module):
    """TorchRec's ShardedModule order: input dist, then per sharding a lookup and an output dist, waited later."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self._lookups = nn.ModuleList([nn.Linear(4, 3), nn.Linear(4, 3)])
        self._output_dists = nn.ModuleList([_Dist(), _Dist()])

    def forward(self, features: Tensor) -> Tensor:
        dist_input = features + 1.0
        awaitables = [dist(lookup(dist_input)) for lookup, dist in zip(self._lookups, self._output_dists)]
        return torch.cat([w.wait() for w in awaitables], dim=1)


def _step(module: nn.Module) -> tuple[Tensor, list[Tensor]]:
    out = module(torch.arange(8.0).view(2, 4))
    out.square().sum().backward()
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    return out.detach(), grads


def test_labels_cover_input_dist_lookup_and_the_all_to_all_both_ways_and_change_nothing() -> None:
    module = _ShardedStandIn()
    plain_out, plain_grads = _step(module)
    labels = StepPhaseLabels()
    labels.install([module])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out, grads = _step(module)
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get(INPUT_DIST) == 1
    assert counts.get(LOOKUP) == 2
    assert counts.get(EMBEDDING_ALL_TO_ALL_FORWARD) == 4  # launch and wait of each sharding's output dist
    assert counts.get(EMBEDDING_ALL_TO_ALL_BACKWARD) == 2
    torch.testing.assert_close(out, plain_out, rtol=0, atol=0)
    for got, expected in zip(grads, plain_grads):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # No profiler: the hooks return nothing, so the outputs are TorchRec's own objects and no range opens.
    assert not step_phases.profiling()
    awaitable = module._output_dists[0](torch.ones(1, 3))
    assert isinstance(awaitable, NoWait)
    labels.remove()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _step(module)
    assert not any(e.key in STEP_PHASES for e in prof.key_averages())


def test_the_hooks_are_on_the_model_only_while_a_profiler_records() -> None:
    module = _ShardedStandIn()
    labels = StepPhaseLabels([module])
    labels.follow_profiler()
    assert not labels.installed and not module._lookups[0]._forward_hooks
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        labels.follow_profiler()  # a training step starts while the profiler records
        assert labels.installed
        _step(module)
    assert any(e.key == LOOKUP for e in prof.key_averages())
    labels.follow_profiler()
    assert not labels.installed and not module._lookups[0]._forward_hooks and not module._forward_pre_hooks


def test_step_phase_is_a_no_op_without_a_profiler() -> None:
    assert type(step_phase(LOOKUP)).__name__ == "nullcontext"
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with step_phase(LOOKUP):
            torch.ones(2).sum()
    assert any(e.key == LOOKUP for e in prof.key_averages())


def test_every_label_is_documented_once() -> None:
    names = [getattr(step_phases, n) for n in dir(step_phases) if n.isupper() and isinstance(getattr(step_phases, n), str)]
    assert sorted(names) == sorted(STEP_PHASES) and len(set(names)) == len(names)
    assert all(label.startswith("recsys:") and STEP_PHASES[label] for label in STEP_PHASES)


def test_every_label_is_in_the_performance_docs() -> None:
    from docs_text import ROOT

    text = (ROOT / "docs" / "performance.md").read_text()
    assert all(f"`{label}`" in text for label in STEP_PHASES), [label for label in STEP_PHASES if f"`{label}`" not in text]
