"""`make demo`'s output prints each line once (issue: every Lightning log line appeared twice).

FBGEMM's import and TorchRec's planning used to give the root logger a handler (``lightning_recsys._upstream_logging``
says where), and Lightning's loggers propagate to it, so each Lightning line came once from Lightning's handler and
once from the root's (``INFO:lightning.fabric.utilities.seed:Seed set to 0``).
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO_CONFIG = ROOT / "examples" / "configs" / "synthetic_dlrm.yaml"  # what `make demo` runs (Makefile)


def repeated_lines(output: str) -> dict[str, int]:
    """Lines printed more than once. Lines without a letter or digit (blank lines, the ``----`` rules that open and
    close Lightning's one "All distributed processes registered" message) are layout, not repeats."""
    counts = collections.Counter(line.rstrip() for line in output.splitlines() if re.search(r"[A-Za-z0-9]", line))
    return {line: n for line, n in counts.items() if n > 1}


def test_repeated_lines_are_found():
    doubled = "INFO: Seed set to 0\nINFO:lightning.fabric.utilities.seed:Seed set to 0\nEpoch 0\nEpoch 0\n----\n----\n"
    assert repeated_lines(doubled) == {"Epoch 0": 2}


@pytest.mark.slow
def test_demo_prints_no_line_twice(tmp_path):
    """The demo's CLI and config on 2 processes, for 3 steps; rank 1's own lines differ by their rank."""
    result = subprocess.run(
        [sys.executable, "-m", "lightning_recsys.cli", "fit", "--config", str(DEMO_CONFIG),
         "--trainer.max_steps", "3", "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    output = result.stdout + result.stderr
    assert "Seed set to 0" in output and "TwoDRecStrategy: 1D sharding over 2 ranks" in output  # the lines that were doubled
    assert "INFO:lightning" not in output, "a root-logger handler printed Lightning's lines (the basicConfig format)"
    assert not repeated_lines(output), f"lines printed more than once: {repeated_lines(output)}"


@pytest.mark.slow
def test_after_a_fit_the_users_basic_config_takes_effect(tmp_path):
    """TorchRec's plan check on a data-parallel table and FBGEMM's table constructor call ``logging.warning`` /
    ``logging.info``; the root logger must still be unconfigured afterwards, so the user's ``basicConfig`` works."""
    script = textwrap.dedent("""
        import logging
        import lightning.pytorch as pl
        from lightning_recsys import PlanningConfig, TwoDRecStrategy
        from lightning_recsys.data import SyntheticClickLogConfig, SyntheticClickLogDataModule
        from lightning_recsys.models import DLRMRanker

        config = SyntheticClickLogConfig(table_sizes=[40, 40], num_dense_features=4, global_batch_size=32, train_batches=2, val_batches=1)
        model = DLRMRanker(table_sizes=config.table_sizes, num_dense_features=4, embedding_dim=8, dense_arch_layer_sizes=[8])
        strategy = TwoDRecStrategy(planning=PlanningConfig(sharding_types=["data_parallel"]))
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, datamodule=SyntheticClickLogDataModule.from_config(config))
        logging.basicConfig(level=logging.INFO, format="USER %(name)s: %(message)s")
        logging.getLogger("my_project").info("hello")
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "data_parallel" in result.stderr + result.stdout, "the plan should hold a data-parallel table"
    assert result.stderr.count("USER my_project: hello") == 1, result.stderr[-3000:]
