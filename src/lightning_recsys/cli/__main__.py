"""``python -m lightning_recsys.cli``: the ``lightning-recsys`` command."""

from lightning_recsys.cli.main import main

main()
