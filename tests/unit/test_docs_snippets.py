"""Every ```python block of the README and the docs/ pages runs (test_docs_commands.py covers the shell commands).

Each block is named below by a line it holds; a new block fails ``test_every_python_block_is_checked``
until it gets a check here. Blocks run as written, except for the few substitutions listed with them
(fewer steps, one process), each of which must match so that a changed page fails loudly.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from docs_text import ROOT, fenced_blocks, name

BLOCKS = [code for _, code in fenced_blocks("python")]

INTRO = "trainer = Trainer(strategy=TwoDRecStrategy(), accelerator=\"cpu\", devices=2)"
QUICK_START = "trainer.fit(model, datamodule=data)"
RANKER = "class ConcatMLPRanker(RankerModule):"  # runs and trains in test_dcn.py
QCOMMS = "# preset"
CONFIG = "table_constraints={\"t_sparse_0\": TableConstraints(sharding_types=[\"row_wise\"])},"
EXPORT = "load_unsharded(\"lightning_logs/version_0/checkpoints/last.ckpt\", model)"
# What the prose around a fragment imports for it.
STRATEGY_IMPORTS = (
    "from lightning.pytorch import Trainer\n"
    "from lightning_recsys import GuardConfig, PlanningConfig, QCommsConfig, TableConstraints, TwoDRecStrategy\n"
)


def block(marker: str) -> str:
    found = [b for b in BLOCKS if marker in b]
    assert len(found) == 1, f"{len(found)} python blocks of the docs hold {marker!r}, not one; update this test"
    return found[0]


def substituted(code: str, *pairs: tuple[str, str]) -> str:
    for old, new in pairs:
        assert code.count(old) == 1, f"the docs block no longer has {old!r} once; update this test"
        code = code.replace(old, new)
    return code


def test_every_python_block_is_checked():
    markers = [INTRO, QUICK_START, RANKER, QCOMMS, CONFIG, EXPORT]
    unchecked = [f"{name(page)}: {code.splitlines()[0]}" for page, code in fenced_blocks("python") if not any(m in code for m in markers)]
    assert not unchecked, f"python blocks of the docs with no check in {Path(__file__).name}: {unchecked}"


def test_strategy_fragments_build():
    gpu = "accelerator=\"gpu\""
    intro = "\n".join(line for line in block(INTRO).splitlines() if gpu not in line or torch.cuda.is_available())
    for code in (intro, block(QCOMMS), block(CONFIG)):
        namespace: dict = {}
        exec(STRATEGY_IMPORTS + code, namespace)


def test_quick_start_then_export(tmp_path):
    """The quick start as ``python train.py`` (one process, 3 steps), then the export block on its checkpoint."""
    script = substituted(
        block(QUICK_START),
        ("devices=2,", "devices=1,"),
        ("max_epochs=3,", "max_steps=3, limit_val_batches=1, enable_progress_bar=False,"),
    )
    (tmp_path / "train.py").write_text(script)
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    (checkpoint,) = (tmp_path / "lightning_logs/version_0/checkpoints").glob("*.ckpt")
    export = substituted(block(EXPORT), ("lightning_logs/version_0/checkpoints/last.ckpt", str(checkpoint)))
    namespace: dict = {}
    exec(export, namespace)
    weight = namespace["model"].dlrm.sparse_arch.embedding_bag_collection.embedding_bags["t_sparse_0"].weight
    assert torch.isfinite(weight).all() and weight.abs().sum() > 0
