"""The 2D rank layout (``ParallelTopology``: sharding and replica groups, their process groups) and
what a failed collective leaves behind: which ranks are lost, errors raised on every rank together."""

from lightning_recsys.parallel.topology.layout import LAYOUTS, Layout, ParallelTopology, check_topology_arguments
from lightning_recsys.parallel.topology.process_group import (
    attempt_scoped_store,
    destroy_process_group_at_exit,
    diagnose_failure,
    looks_like_lost_peer,
    raised_on_every_rank,
    report_lost_ranks,
    report_own_error,
    was_raised_on_every_rank,
)

__all__ = [
    "LAYOUTS",
    "Layout",
    "ParallelTopology",
    "attempt_scoped_store",
    "check_topology_arguments",
    "destroy_process_group_at_exit",
    "diagnose_failure",
    "looks_like_lost_peer",
    "raised_on_every_rank",
    "report_lost_ranks",
    "report_own_error",
    "was_raised_on_every_rank",
]
