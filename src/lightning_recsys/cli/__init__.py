"""The ``lightning-recsys`` command line (``main``) and its parts.

* ``trainer.py``: ``RecSysCLI``/``build_cli``, Lightning's CLI for fit, validate, test and predict;
* ``plan.py``: ``lightning-recsys plan``, the plan report of a config, made by the pipeline training uses;
* ``main.py``: the console script, which sends ``plan`` to ``plan.py`` and the rest to ``RecSysCLI``.
"""

from lightning_recsys._lazy import lazy_exports
from lightning_recsys.cli.main import main

# The trainer and plan commands import Lightning; on first use, so that `prepare` starts without it.
__getattr__, __dir__ = lazy_exports(
    __name__,
    {"RecSysCLI": "lightning_recsys.cli.trainer", "build_cli": "lightning_recsys.cli.trainer", "plan_main": "lightning_recsys.cli.plan"},
    globals(),
)

__all__ = ["RecSysCLI", "build_cli", "main", "plan_main"]
