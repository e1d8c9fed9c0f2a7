"""The ``lightning-recsys`` command line (``main``) and its parts.

* ``trainer.py``: ``RecSysCLI``/``build_cli``, Lightning's CLI for fit, validate, test and predict;
* ``plan.py``: ``lightning-recsys plan``, the plan report of a config, made by the pipeline training uses;
* ``main.py``: the console script, which sends ``plan`` to ``plan.py`` and the rest to ``RecSysCLI``.
"""

from lightning_recsys.cli.main import main
from lightning_recsys.cli.plan import plan_main
from lightning_recsys.cli.trainer import RecSysCLI, build_cli

__all__ = ["RecSysCLI", "build_cli", "main", "plan_main"]
