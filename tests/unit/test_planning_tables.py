"""Planning reads the model's tables once (``planner.tables.model_tables``) and hands the record along.

A *visit* is a call that enters a planner module (from code in another file) with the model among its
arguments: each one walks, or may walk, the module's tables again. Through ``shard_or_reuse`` each planner
module is visited at most twice; before the record, ``torchrec_planner.py`` was visited 5 times with
TorchRec's planner and 4 with the balanced one (``embedding_tables(module)`` at each step).
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Optional

import pytest
import torch

import lightning_recsys.planner as planner_package
import lightning_recsys.planner.tables as tables_module
from lightning_recsys.models import DLRMRanker
from lightning_recsys.parallel import EmbeddingOptimizerConfig, ParallelTopology
from lightning_recsys.parallel.comms import QCommsConfig
from lightning_recsys.planner import PlanningConfig, ReshapeAdvice
from lightning_recsys.strategies import sharding

PLANNER_DIR = Path(planner_package.__file__).parent


@dataclass
class OneProcessStrategy:
    """What ``shard_or_reuse`` reads of a strategy (``sharding.ShardingStrategy``), for one process."""

    planning: PlanningConfig
    sharding_group_size: Optional[int] = None
    layout: Any = "all_to_all_optimized"
    qcomms_config: QCommsConfig = field(default_factory=QCommsConfig)
    embedding_optimizer_config: EmbeddingOptimizerConfig = field(default_factory=EmbeddingOptimizerConfig)
    topology: ParallelTopology = field(default_factory=lambda: ParallelTopology.for_world(ranks_per_node=1, num_nodes=1))
    root_device: torch.device = torch.device("cpu")
    global_rank: int = 0

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj


class _Planned(Exception):
    """Raised in place of ``shard_model``: planning is done, nothing is sharded."""


def _visits(monkeypatch: pytest.MonkeyPatch, planning: PlanningConfig, model: torch.nn.Module) -> Counter[str]:
    def stop(*args: Any, **kwargs: Any) -> None:
        raise _Planned

    monkeypatch.setattr(sharding, "shard_model", stop)
    visits: Counter[str] = Counter()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        path = Path(code.co_filename)
        if PLANNER_DIR not in path.parents or (frame.f_back is not None and frame.f_back.f_code.co_filename == code.co_filename):
            return
        arguments = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if any(frame.f_locals.get(name) is model for name in arguments):
            visits[path.relative_to(PLANNER_DIR).as_posix()] += 1

    sys.setprofile(profile)
    try:
        sharding.shard_or_reuse(OneProcessStrategy(planning=planning), model)  # type: ignore[arg-type]
    except _Planned:
        pass
    finally:
        sys.setprofile(None)
    return visits


@pytest.mark.parametrize("planner", ["torchrec", "balanced"])
def test_shard_or_reuse_visits_each_planner_module_at_most_twice(monkeypatch, planner):
    visits = _visits(monkeypatch, PlanningConfig(planner=planner), DLRMRanker(table_sizes=[100, 200], embedding_dim=8))
    assert max(visits.values()) <= 2, f"planner modules entered with the model more than twice: {visits}"
    assert visits["tables.py"] == 1, visits  # the tables are read once
    assert "pipeline.py" in visits and "report.py" in visits, visits  # the walk did plan and report


def test_a_reshape_reads_the_new_tables_once_more(monkeypatch):
    reshaped: list[tuple[ReshapeAdvice, ...]] = []
    advice = (ReshapeAdvice(table="t_sparse_0", rows=100, dim=8, new_rows=200, new_dim=4, bytes_before=2.0, bytes_after=1.0),)

    def suggest(*args: Any, **kwargs: Any) -> list[ReshapeAdvice]:
        reshaped.append(advice)
        return list(advice)

    monkeypatch.setattr("lightning_recsys.planner.pipeline.suggest_reshape", suggest)
    calls = Counter()
    derive = tables_module.model_tables

    def counted(module: torch.nn.Module) -> Any:
        calls["model_tables"] += 1
        return derive(module)

    for name in ("lightning_recsys.planner.tables", "lightning_recsys.planner.pipeline", "lightning_recsys.strategies.sharding"):
        monkeypatch.setattr(f"{name}.model_tables", counted)
    model = DLRMRanker(table_sizes=[100, 200], embedding_dim=8)
    visits = _visits(monkeypatch, PlanningConfig(reshape_tables=True), model)
    assert reshaped, "the reshape advice was not asked for"
    assert calls["model_tables"] == 2  # before the reshape and after it
    assert max(visits.values()) <= 2, visits
