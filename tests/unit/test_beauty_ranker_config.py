"""examples/configs/beauty_ranker.yaml: it builds, every argument has a comment, its batches train the ranker,
and the pretrainer of beauty_pretrain.yaml fits it (a warm start copies every pretrainer tensor)."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from lightning_recsys.checkpoint.warm_start import parts_selection, select_weights
from lightning_recsys.cli import build_cli
from lightning_recsys.data import SequenceFileRankingDataModule
from lightning_recsys.models import SequencePretrainer, SequenceRanker

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"


def test_beauty_ranker_builds_and_every_argument_has_a_comment(tmp_path):
    text = (CONFIGS / "beauty_ranker.yaml").read_text()
    parsed = yaml.safe_load(text)
    lines = {line.strip().split(":")[0]: line for line in text.splitlines() if ":" in line}
    names = [*parsed["model"]["init_args"], *parsed["data"]["init_args"]]
    assert not [n for n in names if "#" not in lines[n]]
    (tmp_path / "beauty.txt").write_text("".join(f"{u} {1 + (u * 7 + k) % 40}\n" for u in range(1, 9) for k in range(6)))
    cli = build_cli([
        "--config", str(CONFIGS / "beauty_ranker.yaml"), "--data.path", str(tmp_path / "beauty.txt"), "--data.num_items", "40",
        "--data.global_batch_size", "4", "--model.init_args.item_table_size", "40", "--model.init_args.embedding_device", "null",
    ], run=False)  # fmt: skip
    model, data = cli.model, cli.datamodule
    assert isinstance(model, SequenceRanker) and isinstance(data, SequenceFileRankingDataModule)
    assert model.hparams.max_history == data.max_history + 1  # the history and the appended candidate
    batch = next(iter(data._dataset("train", 0, 1)))
    assert torch.isfinite(model.training_losses(batch)["loss"])


def test_the_beauty_pretrainer_warm_starts_the_beauty_ranker_without_include():
    pretrain = build_cli(["--config", str(CONFIGS / "beauty_pretrain.yaml"), "--data.path", "beauty.txt"], run=False).model
    ranker = build_cli(["--config", str(CONFIGS / "beauty_ranker.yaml"), "--data.path", "beauty.txt"], run=False).model
    assert isinstance(pretrain, SequencePretrainer) and isinstance(ranker, SequenceRanker)
    source, target = pretrain.state_dict(), ranker.state_dict()
    mapping = select_weights(list(source), set(target))  # every pretrainer tensor has a place in the ranker
    assert len(mapping) == len(source)
    assert all(target[t].shape == source[s].shape for t, s in mapping.items())
    # By role too (the config's command uses --trainer.callbacks.parts '[encoder, item_table]'): same kinds, same tensors.
    include, rename, _ = parts_selection("beauty_pretrain", ranker.warm_start_parts(), pretrain.warm_start_parts(), list(source), set(target))
    assert len(select_weights(list(source), set(target), include=include, rename=rename)) == len(source)
