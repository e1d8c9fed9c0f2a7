"""Planning once for every rank: run on rank 0, hand the result (or the error) to every rank.

A ``Broadcast`` is any callable that every rank calls with an object and that returns rank 0's
object: ``broadcast_over(group)`` over a torch process group, a Trainer strategy's ``broadcast``,
or the identity in one process. No Lightning imports.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist
from torch import nn
from torchrec.distributed.planner.types import PlannerError, PlannerErrorType
from torchrec.distributed.types import ModuleSharder, ShardingPlan, ShardingPlanner

Broadcast = Callable[[Any], Any]
T = TypeVar("T")


def no_broadcast(obj: T) -> T:
    """The ``Broadcast`` of a single process: rank 0's object is this one."""
    return obj


def broadcast_over(group: dist.ProcessGroup | None = None) -> Broadcast:
    """A ``Broadcast`` of picklable objects from the first rank of ``group`` (default WORLD).

    The source is that rank's global rank, as ``broadcast_object_list`` wants, so subgroups work
    (TorchRec's ``invoke_on_rank_and_broadcast_result``, in ``distributed/collective_utils.py``, passes
    the group-local rank as ``src``). Without an initialized process group, or in a group of one, it
    returns the object itself.
    """

    def broadcast(obj: Any) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        pg = group if group is not None else dist.group.WORLD
        assert pg is not None
        if dist.get_world_size(pg) == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg)
        return box[0]

    return broadcast


@dataclass(frozen=True)
class _Failed:
    """An exception, as rank 0 sends it: its type's name, its message, TorchRec's error type."""

    kind: str
    message: str
    planner_error_type: str | None

    @classmethod
    def of(cls, err: BaseException) -> _Failed:
        error_type = getattr(err, "error_type", None)
        return cls(type(err).__name__, str(err), getattr(error_type, "value", None) if isinstance(err, PlannerError) else None)

    def rebuild(self) -> Exception:
        if self.kind == "PlannerError":
            kind = PlannerErrorType(self.planner_error_type) if self.planner_error_type else PlannerErrorType.OTHER
            return PlannerError(self.message, kind)
        builtin = getattr(builtins, self.kind, None)
        if isinstance(builtin, type) and issubclass(builtin, Exception):
            return builtin(self.message)
        return RuntimeError(f"{self.kind} on rank 0: {self.message}")


def on_rank_zero(fn: Callable[[], T], *, rank: int, broadcast: Broadcast) -> T:
    """``fn()`` run on rank 0, its result returned on every rank; what it raises is raised on every rank.

    Rank 0 raises its own exception; the others raise one of the same type (builtin exceptions
    and TorchRec's ``PlannerError``; others become a ``RuntimeError`` naming the type) with the
    same message. Every rank must call it, with the same ``broadcast``.
    """
    payload: Any = None
    error: Exception | None = None
    if rank == 0:
        try:
            payload = ("ok", fn())
        except Exception as err:  # every rank must leave the broadcast, whatever rank 0 hit
            error = err
            payload = ("error", _Failed.of(err))
    payload = broadcast(payload)
    if error is not None:
        raise error
    status, value = payload
    if status == "error":
        raise value.rebuild()
    return value


def plan_for_every_rank(
    planner: ShardingPlanner,
    module: nn.Module,
    sharders: list[ModuleSharder[nn.Module]],
    group: dist.ProcessGroup | None = None,
) -> ShardingPlan:
    """``planner.plan(module, sharders)`` on the first rank of ``group`` (default WORLD), for every rank.

    Unlike TorchRec's ``collective_plan``, which leaves the other ranks waiting in the broadcast
    when rank 0 fails, rank 0's error is raised on every rank. Without a process group, it plans here.
    """
    rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
    return on_rank_zero(lambda: planner.plan(module, sharders), rank=rank, broadcast=broadcast_over(group))
