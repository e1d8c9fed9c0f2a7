"""Undo the root-logger handler that upstream libraries install behind the user's back.

The stdlib's module-level ``logging.info()``, ``logging.warning()``, ... call ``logging.basicConfig()`` when the root
logger has no handler (CPython ``Lib/logging/__init__.py``, ``info()`` and its siblings), so one such call in a
library gives the root logger a ``StreamHandler`` to stderr. Lightning's loggers have their own handler and also
propagate to the root, so after that every Lightning line was printed twice. Where it happens:

* importing FBGEMM: ``fbgemm_gpu/__init__.py``, ``_load_library``: ``logging.info(f"Successfully loaded: ...")``
  (``import torchrec`` imports it);
* TorchRec's plan check on data-parallel tables: ``torchrec/distributed/planner/planners.py``,
  ``validate_rank_assignment``: ``logging.warning(f"Sharding spec not found for ...")``;
* FBGEMM's fused tables, built when a model is sharded: ``fbgemm_gpu/split_table_batched_embeddings_ops_training.py``,
  ``SplitTableBatchedEmbeddingBagsCodegen.log``: ``logging.info(f"[TBE={self.uuid}] {msg}")``.

Lightning decides at its import whether its loggers get their own handler and stop propagating (when the root has
none: ``lightning/pytorch/__init__.py``), so the handler left by FBGEMM's import is the one that doubled its lines. A
handler added later doubles nothing, but it still turns a user's later ``logging.basicConfig()`` into a no-op.

``root_logger_left_unconfigured()`` removes what such a call added, and only that: the handlers the root logger
gained inside the block, and only when it had none when the block began. A root logger configured before (by the
user's ``logging.basicConfig``, say) is never touched, and one configured later keeps its handlers.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from lightning_recsys._import_hooks import ExecModule, wrap_first_import

UPSTREAM_MODULE = "fbgemm_gpu"  # the first import that configures the root logger (see above)


@contextlib.contextmanager
def root_logger_left_unconfigured() -> Iterator[None]:
    """Inside the block upstream code may call ``logging.info()`` and the like; the root logger ends as it began."""
    root = logging.getLogger()
    if root.handlers:  # configured already (by the user, or before we were imported): not ours to change
        yield
        return
    try:
        yield
    finally:
        for handler in list(root.handlers):  # it had none: every handler now was added inside the block
            root.removeHandler(handler)


def _imported_without_root_handler(exec_module: ExecModule) -> ExecModule:
    def exec_module_left_unconfigured(module: object) -> None:
        with root_logger_left_unconfigured():
            exec_module(module)  # type: ignore[arg-type]

    return exec_module_left_unconfigured


def keep_upstream_import_from_configuring_logging() -> None:
    """Run FBGEMM's first import (unless it is imported already) inside ``root_logger_left_unconfigured``."""
    wrap_first_import(UPSTREAM_MODULE, _imported_without_root_handler)
