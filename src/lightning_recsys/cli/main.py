"""``lightning-recsys``: one command, the Trainer's subcommands, ``plan`` and ``prepare``.

    lightning-recsys fit --config examples/configs/synthetic_dlrm.yaml
    lightning-recsys fit --config examples/configs/movielens_dlrm.yaml --data.path data/ml-100k
    lightning-recsys fit --config examples/configs/synthetic_dlrm.yaml --print_config
    lightning-recsys plan --config examples/configs/synthetic_dlrm.yaml
    lightning-recsys plan --config examples/configs/two_node_2d_fp8.yaml --planner balanced --compare
    lightning-recsys prepare --input 'events/*.parquet' --output prepared --time-column ts
"""

from __future__ import annotations

import sys
from typing import Optional


def main(args: Optional[list[str]] = None) -> None:
    """The console script: ``plan`` and ``prepare`` run here, everything else goes to ``RecSysCLI``."""
    argv = sys.argv[1:] if args is None else list(args)
    # Each command imports only what it needs: `prepare` runs without torch and Lightning.
    if argv[:1] == ["plan"]:
        from lightning_recsys.cli.plan import plan_main  # noqa: PLC0415

        raise SystemExit(plan_main(argv[1:]))
    if argv[:1] == ["prepare"]:
        from lightning_recsys.cli.prepare import prepare_main  # noqa: PLC0415

        raise SystemExit(prepare_main(argv[1:]))
    from lightning_recsys.cli.trainer import build_cli  # noqa: PLC0415

    build_cli(args)
