"""The pretraining part of ``benchmarks/cost_model.py``: the traffic model against exact counts, and the pretraining regime map.

1. **Check** (``pretrain_check``): the benchmark's pretraining workload (``_pretrain_workload.py``: Beauty-like
   lengths, Zipf items, a shared pool of uniform negatives) is learned from every rank's first batches
   (``PretrainWorkload.from_batches``), then its expected ids per feature, with and without index dedup, are set
   against the exact counts of later batches at two batch sizes, as the accounting files them
   (``parallel/comms/lookup_traffic.feature_ids``). Target: within 25% (the cost model's validated error).
2. **Regime map** (``pretrain_regime``, a model, not a measurement): ``recommend`` at 8 nodes x 8 GPUs for a
   foundation-scale item table (1e8 rows x dim 128, batch 256 per GPU) over tokens per example, Zipf skew and the
   negatives; compute per step stated per input token (one pool of 1024 per GPU's batch, or 128 per example).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import _pretrain_workload as pretrain

from lightning_recsys.parallel.comms.lookup_traffic import TableRoute, feature_ids
from lightning_recsys.planner.cost.layout_advice import Hardware, recommend
from lightning_recsys.planner.cost.pretrain_traffic import HISTORY, NEGATIVES, TARGETS, PretrainWorkload

TOLERANCE = 0.25
ROUTE = TableRoute(table="item", features=(HISTORY, TARGETS, NEGATIVES), pieces=())
WORLD = 4


def _workload_args(global_batch: int) -> argparse.Namespace:
    return argparse.Namespace(items=1_000_000, pretrain_users=40_000, mean_length=8.9, max_length=20, num_negatives=256,
                              transformer_layers=1, zipf_exponent=1.05, embedding_dim=64, global_batch_size=global_batch, seed=0)  # fmt: skip


def _synthetic(global_batch: int, count: int, skip: int) -> list[Any]:
    per_rank = pretrain.training_batches(_workload_args(global_batch), WORLD, skip + count)
    return [b for bs in per_rank.values() for b in bs[skip:]]


def _sequence_file(path: Path) -> Any:
    from lightning_recsys.data.sequences import SequenceFileDataModule

    def batches(global_batch: int, count: int, skip: int) -> list[Any]:
        data = SequenceFileDataModule(path=str(path), max_length=50, num_negatives=3000, global_batch_size=global_batch, seed=0)
        out = []
        for rank in range(WORLD):
            stream = iter(data._dataset("train", rank, WORLD))
            out += [next(stream) for _ in range(skip + count)][skip:]
        return out

    return batches


def _check_source(name: str, batches: Any, items: int, learn_at: int, predict_at: tuple[int, ...]) -> list[dict[str, Any]]:
    """Learn from 4 batches per rank at ``learn_at``, then the expected ids per feature beside exact counts of later batches."""
    learned = PretrainWorkload.from_batches(batches(learn_at, 4, 0), items=items, dim=64)
    rows = []
    for global_batch in predict_at:
        sample = batches(global_batch, 4, 4)
        workload = PretrainWorkload(items=items, dim=64, batch_per_rank=global_batch // WORLD, tokens_per_example=learned.tokens_per_example,
                                    num_negatives=learned.num_negatives, zipf_exponent=learned.zipf_exponent)  # fmt: skip
        for dedup in (False, True):
            exact = {feature: 0.0 for feature in ROUTE.features}
            for batch in sample:
                for feature, ids in feature_ids(batch.sparse, ROUTE, index_dedup=dedup).items():
                    exact[feature] += ids.numel() / len(sample)
            for feature, expected in workload.ids_per_rank(index_dedup=dedup).items():
                rows.append({"source": name, "global_batch": global_batch, "index_dedup": dedup, "feature": feature, "expected": expected,
                             "exact": exact[feature], "ratio": expected / exact[feature] if exact[feature] else None,
                             "learned_tokens_per_example": learned.tokens_per_example, "learned_zipf": learned.zipf_exponent})  # fmt: skip
    return rows


def pretrain_check(sequence_file: Path | None = None) -> list[dict[str, Any]]:
    """The emulated pretraining workload (learned at global batch 1024; checked at 1024 and 4096) and, given a sequence file
    (Amazon Beauty, ``docs/pretraining.md``), the same on its batches (learned at 128; checked at 128, 512 and 2048)."""
    rows = _check_source("synthetic (emulated workload)", _synthetic, 1_000_000, 1024, (1024, 4096))
    if sequence_file is not None and sequence_file.exists():
        from lightning_recsys.data.sequences.reader import read_sequence_file

        items = read_sequence_file(str(sequence_file)).num_items
        rows += _check_source(sequence_file.name, _sequence_file(sequence_file), items, 128, (128, 512, 2048))
    print("\n## 5. Pretraining traffic against exact counts: ids per rank of each feature, learned from 4 batches per rank "
          "(tokens per example, the pool, a Zipf exponent fitted to the history's distinct ids), beside exact counts of later "
          "batches (4 ranks)\n")  # fmt: skip
    print("| source (learned T, Zipf) | global batch | index dedup | feature | expected | exact | ratio |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['source']} ({r['learned_tokens_per_example']:.2f}, {r['learned_zipf']:.2f}) | {r['global_batch']} | "
              f"{'yes' if r['index_dedup'] else 'no'} | {r['feature']} | {r['expected']:,.0f} | {r['exact']:,.0f} | {r['ratio']:.3f} |")  # fmt: skip
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    print(f"\nWithin {TOLERANCE:.0%} on every row: {'YES' if all(abs(r['ratio'] - 1) <= TOLERANCE for r in rows) else 'NO'} "
          f"(largest error {worst['ratio'] - 1:+.1%}: {worst['source']}, {worst['feature']}, batch {worst['global_batch']}, "
          f"dedup {worst['index_dedup']}).")  # fmt: skip
    return rows


MIN_COMPUTE_MS = 2.0


def pretrain_regime(hardware: Hardware, compute_ms_per_1k_tokens: float) -> list[dict[str, Any]]:
    """``recommend`` at 8 nodes for each regime; compute per step stated: ``compute_ms_per_1k_tokens`` per 1000 input
    tokens of a GPU's batch, at least ``MIN_COMPUTE_MS`` (a small SASRec-like decoder is cheap per token on a GPU)."""
    out = []
    for tokens in (6, 50, 200):
        for zipf in (0.8, 1.05, 1.3):
            for shared in (True, False):
                workload = PretrainWorkload(items=100_000_000, dim=128, batch_per_rank=256, tokens_per_example=float(tokens),
                                            num_negatives=1024 if shared else 128, shared_negatives=shared, zipf_exponent=zipf)  # fmt: skip
                compute = max(MIN_COMPUTE_MS, compute_ms_per_1k_tokens * 256 * tokens / 1000) / 1e3
                shape = workload.model_shape(dense_param_bytes=4 * 20e6, compute_s=compute)
                advice = recommend(shape, hardware, 8)
                dedup = workload.ids_per_rank(index_dedup=True)
                plain = workload.ids_per_rank(index_dedup=False)
                out.append({"tokens_per_example": tokens, "zipf_exponent": zipf, "shared_negatives": shared, "compute_s": compute,
                            "best": advice.best.layout.describe(), "best_scaling": advice.best.scaling,
                            "other": advice.best_other_kind.layout.describe(), "other_scaling": advice.best_other_kind.scaling,
                            "confidence": advice.confidence, "dedup_keeps": sum(dedup.values()) / sum(plain.values()),
                            "negative_share": plain[NEGATIVES] / sum(plain.values())})  # fmt: skip
    print(f"\n## 6. Pretraining regime map (model, not measured): 8 nodes x {hardware.gpus_per_node} GPUs, {hardware.inter_gbit_s:g} Gb/s "
          f"per node; item table 1e8 x dim 128, batch 256 per GPU; compute {compute_ms_per_1k_tokens:g} ms per 1000 input tokens "
          f"of a GPU's batch, at least {MIN_COMPUTE_MS:g} ms; negatives: a pool of 1024 per GPU's batch, or 128 per example; "
          "2D sync interval <= 4\n")  # fmt: skip
    print("| tokens/example | Zipf | negatives | negatives' share of ids | dedup keeps | best (scaling) | best of the other kind | confidence |")
    print("|---|---|---|---|---|---|---|---|")
    for r in out:
        print(f"| {r['tokens_per_example']} | {r['zipf_exponent']:g} | {'pool 1024' if r['shared_negatives'] else '128 per example'} | "
              f"{r['negative_share']:.0%} | {r['dedup_keeps']:.0%} | {r['best']} ({r['best_scaling']:.2f}x) | {r['other']} "
              f"({r['other_scaling']:.2f}x) | {r['confidence']} |")  # fmt: skip
    return out
