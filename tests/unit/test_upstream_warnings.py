"""Known upstream warnings are silenced by message, category and module; everything else still shows."""

from __future__ import annotations

import logging
import warnings

import pytest

from lightning_recsys.parallel.sharding import upstream_warnings
from lightning_recsys.parallel.sharding.upstream_warnings import KNOWN_LOG_MESSAGES, silence_known_upstream_warnings

# (message, category, the module that emits it), as seen on a 2-process training run.
EMITTED = [
    ("`torch.distributed.reduce_scatter_tensor` is deprecated. Please use ...", FutureWarning, "torch.distributed.c10d_logger"),
    ("`torch.distributed.all_gather_into_tensor` is deprecated. Please use ...", FutureWarning, "torch.distributed.c10d_logger"),
    ("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead.", FutureWarning, "torchrec.distributed.model_parallel"),
    ("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead.", FutureWarning, "torchrec.distributed.embeddingbag"),
    ("HeuristicalStorageReservation is known to cause issues, particularly ...", FutureWarning, "torchrec.distributed.planner.planners"),
    ("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning, "torchrec.distributed.embeddingbag"),
    ("fbgemm::split_embedding_codegen_lookup_sgd_function_cpu: an autograd kernel was not registered to the Autograd key(s) but we are trying to backprop through it.", UserWarning, "torch.autograd.graph"),
    ("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning, "lightning.pytorch.utilities._pytree"),
    ("torch.distributed.nn.functional.all_gather is deprecated, use torch.distributed._functional_collectives.all_gather_single instead.",
     FutureWarning, "lightning.fabric.utilities.distributed"),
]


def _emit(message: str, category: type[Warning], module: str) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        upstream_warnings._installed = False
        warnings.simplefilter("always")
        silence_known_upstream_warnings()
        warnings.warn_explicit(message, category, filename=module.replace(".", "/") + ".py", lineno=1, module=module)
    return [str(w.message) for w in caught]


@pytest.mark.parametrize(("message", "category", "module"), EMITTED, ids=[m[:40] for m, _, _ in EMITTED])
def test_known_upstream_warning_is_silenced(message, category, module):
    assert _emit(message, category, module) == []


@pytest.mark.parametrize(
    ("message", "category", "module"),
    [
        ("my own deprecation: `foo` is deprecated", FutureWarning, "my_project.model"),
        ("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead.", FutureWarning, "my_project.model"),  # same text, user code
        ("HeuristicalStorageReservation is known to cause issues", UserWarning, "torchrec.distributed.planner"),  # other category
        ("a new torchrec warning", FutureWarning, "torchrec.distributed.model_parallel"),
    ],
)
def test_other_warnings_still_show(message, category, module):
    assert _emit(message, category, module) == [message]


def _log(logger: logging.Logger, message: str, pathname: str) -> None:
    record = logger.makeRecord(logger.name, logging.WARNING, pathname, 1, message, None, None)
    if logger.filter(record):
        logger.handle(record)


def test_known_torchrec_log_lines_are_dropped_and_others_kept(caplog):
    silence_known_upstream_warnings()
    for logger_name, text, origin in KNOWN_LOG_MESSAGES:
        logger = logging.getLogger(logger_name)
        with caplog.at_level(logging.WARNING, logger=logger_name):
            caplog.clear()
            _log(logger, f"Sharding Type is data_parallel, {text} t_0", "/site-packages/" + origin)
            _log(logger, "something else", "/site-packages/" + origin)
            _log(logger, f"my own: {text}", "/home/me/train.py")  # the same words from a user's code still show
        assert [r.getMessage() for r in caplog.records] == ["something else", f"my own: {text}"]
