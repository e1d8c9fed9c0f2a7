"""Known, harmless upstream warnings, silenced narrowly (by message, category and module), once.

Each entry names what emits it and why it does not concern a user of this package. Anything else,
a user's own warnings included, still shows.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class KnownWarning:
    message: str  # regex matched against the start of the message
    category: type[Warning]
    module: str  # regex matched against the module the warning is attributed to
    why: str


KNOWN_WARNINGS: tuple[KnownWarning, ...] = (
    KnownWarning(
        r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated", FutureWarning,
        r"torch\.distributed\.c10d_logger", "TorchRec 1.8's row-wise sharding calls the old names; torch 2.13 forwards them",
    ),
    KnownWarning(
        r"`broadcast_buffers` is deprecated", FutureWarning, r"torchrec\.distributed\.(model_parallel|embeddingbag|embedding)\Z",
        "TorchRec's DDP wrappers (dense part, data-parallel tables) pass it; the behaviour is unchanged",
    ),
    KnownWarning(
        r"HeuristicalStorageReservation is known to cause issues", FutureWarning, r"torchrec\.distributed\.planner",
        "it over-estimates only in dry runs on meta tensors; the plan report shows the storage it chose",
    ),
    KnownWarning(
        r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning, r"(torch|torchrec|lightning_recsys)(\.|$)",
        "TorchRec 1.8 keeps its shards in ShardedTensor; nothing to change on the user's side",
    ),
    KnownWarning(
        r".*autograd kernel was not registered to the Autograd key", UserWarning, r"torch(\.|$)",
        "FBGEMM's CPU TBE ops run their backward through TorchRec's own autograd function",
    ),
    KnownWarning(
        r"`isinstance\(treespec, LeafSpec\)` is deprecated", Warning, r"lightning\.pytorch\.utilities\._pytree",
        "Lightning 2.6's own use of a torch pytree API, on every step's batch",
    ),
    KnownWarning(
        r"torch\.distributed\.nn\.functional\.all_gather is deprecated", FutureWarning, r"lightning\.fabric\.utilities\.distributed",
        "Lightning 2.6's strategy.all_gather (_all_gather_ddp_if_available) calls it; once per rank at the end of fit (RunSummary)",
    ),
)

# TorchRec logs these with logging.warning, once per table and rank: (logger, text, the file that logs it).
KNOWN_LOG_MESSAGES: tuple[tuple[str, str, str], ...] = (
    # data-parallel tables have no cache to configure
    ("torchrec.distributed.utils", "caching params will be ignored", "torchrec/distributed/utils.py"),
    ("torchrec.distributed.planner.storage_reservations", "There is a known issue with TorchRec's dense tensor size calculation",
     "torchrec/distributed/planner/storage_reservations.py"),
    # data-parallel tables have no sharding spec; logged on the root logger by the plan validation
    ("", "Sharding spec not found for ", "torchrec/distributed/planner/planners.py"),
    # the sparse-dist pipeline's fx trace (TorchRec's _rewrite_model) reaches torch's is_fx_tracing notice
    ("torch.fx._symbolic_trace", "is_fx_tracing will return true", "torch/fx/_symbolic_trace.py"),
)

_installed = False


class _DropMessage(logging.Filter):
    def __init__(self, text: str, origin: str) -> None:
        super().__init__()
        self.text = text
        self.origin = origin

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.pathname.replace("\\", "/").endswith(self.origin) and self.text in record.getMessage())


def silence_known_upstream_warnings() -> None:
    """Install the filters for ``KNOWN_WARNINGS`` and ``KNOWN_LOG_MESSAGES`` (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    for known in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=known.message, category=known.category, module=known.module)
    for logger_name, text, origin in KNOWN_LOG_MESSAGES:
        logging.getLogger(logger_name).addFilter(_DropMessage(text, origin))

