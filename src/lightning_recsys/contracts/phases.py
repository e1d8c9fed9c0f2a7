"""Profiler ranges: how any layer labels a part of a step in a ``torch.profiler`` trace, at no cost without a profiler.

``lightning_recsys.parallel.step_phases`` holds the runtime's labels and hooks; a model labels its own
parts (e.g. ``"pretrain:encoder"``) with ``step_phase`` from here.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

__all__ = ["profiling", "step_phase"]


def profiling() -> bool:
    """Whether a profiler (``torch.profiler`` or the legacy one) is recording now."""
    return torch._C._autograd._profiler_enabled()  # torch's own check (torch/autograd/profiler.py); no public one


def step_phase(label: str) -> AbstractContextManager[Any]:
    """A ``record_function`` range named ``label`` while a profiler records; otherwise nothing."""
    return torch.autograd.profiler.record_function(label) if profiling() else nullcontext()
