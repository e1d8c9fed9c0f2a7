"""The pretraining workload of ``overhead.py --workload pretrain``: the shipped Beauty batch, its model and its loops.

The batch is ``examples/configs/beauty_pretrain.yaml``'s: ``SequencePretrainer`` (SASRec, 2 blocks,
1 head, width 64, length 50, dropout 0.1), global batch 128 users, 16,384 uniform negatives per
local batch, FBGEMM's fused row-wise Adagrad (lr 0.05) for the item table, Adam (1e-3) for the
transformer. The table is row-wise over the 2 processes in every TorchRec variant (the planner's
choice for the shipped config, pinned here so the raw and the Lightning loops shard alike).

Data: ``--pretrain-path beauty.txt`` (BERT4Rec's Amazon Beauty, 54,542 items) through
``SequenceFileDataModule``'s split and batches; without it, ``BeautyLikeSequences``: 40,226 users
over 54,542 items, each with ``5 + floor(LogNormal(0.6, 1.3))`` items (at most 293), items uniform.
Fitted to Beauty's per-user counts (min 5; quartiles 5, 6, 9; 90th and 99th percentiles 14 and 41;
mean 8.8), it gives the same mean training input (about 5.6 items per user once cut to 50).

Tokens (the throughput unit): the input positions that carry a next-item target, i.e. the
non-padding positions of ``item_id`` (its lengths, already cut to ``max_length``), summed over the
global batch. Padding positions and negatives are not tokens.

Variants (``overhead.py`` interleaves them):

* ``raw``: ``DistributedModelParallel`` over the pretrainer's training loss and a plain loop
  (forward, backward, Adam step; the table's update is fused into backward);
* ``raw_pipeline``: the same driven by TorchRec's ``TrainPipelineSparseDist``;
* ``lightning`` / ``lightning_off``: ``Trainer(strategy=TwoDRecStrategy(...))``, pipeline on and off;
* ``plain``: ``_plain_pretrain.PlainSASRec`` (``nn.Embedding(sparse=True)``, torch's Adagrad for
  the table and Adam for the rest), ONE process with ``torch.set_num_threads(2)``, no TorchRec in
  the step: the shipped config on one device (local batch = the global batch of 128, one pool of
  16,384 negatives), batches padded ahead, as a plain PyTorch data loader would hand them over;
* ``plain_adam``: the same with dense Adam on the table too (as SASRec+'s own code trains).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

BEAUTY_USERS, BEAUTY_ITEMS = 40_226, 54_542
PRETRAIN_VARIANTS = ("raw", "raw_pipeline", "lightning", "lightning_off", "plain", "plain_adam")
PLAIN_THREADS = 2


@dataclass(frozen=True)
class PretrainWorkload:
    """The shipped Beauty batch and model; ``path`` None draws ``BeautyLikeSequences``."""

    path: str | None = None
    global_batch: int = 128
    max_length: int = 50
    num_negatives: int = 16_384
    embedding_dim: int = 64
    num_layers: int = 2
    num_heads: int = 1
    dropout: float = 0.1
    num_items: int = BEAUTY_ITEMS
    num_users: int = BEAUTY_USERS
    table_lr: float = 0.05
    dense_lr: float = 1e-3
    unique_batches: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("global_batch", "max_length", "num_negatives", "embedding_dim", "num_items", "num_users", "unique_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        if self.embedding_dim % 4:
            raise ValueError(f"embedding_dim={self.embedding_dim} must be a multiple of 4 (FBGEMM's sharded kernels).")

    def describe(self) -> str:
        source = f"{self.path}" if self.path else f"BeautyLikeSequences ({self.num_users} users x {self.num_items} items)"
        return (f"SequencePretrainer dim {self.embedding_dim}, {self.num_layers} blocks, {self.num_heads} head(s), length "
                f"{self.max_length}; global batch {self.global_batch} users, {self.num_negatives} negatives per local batch; "
                f"row-wise Adagrad {self.table_lr} (table), Adam {self.dense_lr} (dense); data: {source}")


def beauty_like_lengths(num_users: int, rng: np.random.Generator) -> np.ndarray:
    """Items per user: ``5 + floor(LogNormal(0.6, 1.3))``, at most 293 (Beauty's longest user)."""
    return np.minimum(5 + np.floor(rng.lognormal(0.6, 1.3, num_users)).astype(np.int64), 293)


def _data_module(workload: PretrainWorkload) -> Any:
    from lightning_recsys.data import SequenceFileDataModule
    from lightning_recsys.data.sequences import SequencePretrainDataModule, UserSequences

    common = dict(max_length=workload.max_length, num_negatives=workload.num_negatives, global_batch_size=workload.global_batch,
                  shuffle=True, seed=workload.seed)
    if workload.path:
        return SequenceFileDataModule(workload.path, num_items=workload.num_items, **common)

    class BeautyLikeSequences(SequencePretrainDataModule):
        def _load(self) -> UserSequences:
            rng = np.random.default_rng(workload.seed)
            lengths = beauty_like_lengths(workload.num_users, rng)
            items = rng.integers(0, workload.num_items, int(lengths.sum()), dtype=np.int64)
            return UserSequences(items=items, offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                                 user_ids=np.arange(1, workload.num_users + 1), num_items=workload.num_items)

    return BeautyLikeSequences(**common)


def pretrain_batches(workload: PretrainWorkload, rank: int, world_size: int, steps: int) -> list[Any]:
    """Rank ``rank``'s ``SequenceBatch`` of the first ``unique_batches`` global training batches, cycled to ``steps``."""
    from lightning_recsys.data.sequences import SequenceSplitDataset

    module = _data_module(workload)
    dataset = SequenceSplitDataset(
        module.split, "train", rank=rank, world_size=world_size, global_batch_size=workload.global_batch,
        max_length=workload.max_length, num_negatives=workload.num_negatives, shuffle=True, seed=workload.seed,
    )
    unique = []
    for batch in dataset:
        unique.append(batch)
        if len(unique) == min(workload.unique_batches, len(dataset)):
            break
    return [unique[i % len(unique)] for i in range(steps)]


def tokens(batch: Any) -> int:
    """Input positions with a next-item target (non-padding positions of ``item_id``) in one ``SequenceBatch``."""
    return int(batch.sparse["item_id"].lengths().sum())


def pretrainer(workload: PretrainWorkload, embedding_device: str | None = "meta") -> Any:
    from lightning_recsys.models import SequencePretrainer

    torch.manual_seed(workload.seed)
    return SequencePretrainer(
        num_items=workload.num_items, embedding_dim=workload.embedding_dim, max_length=workload.max_length,
        num_layers=workload.num_layers, num_heads=workload.num_heads, dropout=workload.dropout,
        embedding_device=embedding_device, dense_optimizer="adam", dense_lr=workload.dense_lr,
    )


class TrainingLoss(nn.Module):
    """The pretrainer's training loss as a module's forward, what a hand-written DMP loop wraps.

    Returns ``(loss, loss)``: TorchRec's ``TrainPipelineSparseDist`` expects ``(losses, output)``.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.fx._symbolic_trace.is_fx_tracing():
            # TrainPipelineSparseDist fx-traces forward only to find the sharded modules' inputs
            # (torchrec/distributed/train_pipeline/utils.py, _rewrite_model); the loss's data-dependent
            # shapes cannot be traced, the pretrainer's forward (the lookup and the encoder) can.
            hidden = self.model(batch)
            return hidden, hidden
        loss = self.model.training_losses(batch)["loss"]
        return loss, loss


def raw_loop(workload: PretrainWorkload, rank: int, world_size: int, steps: int, pipelined: bool, profile: Any = None) -> list[tuple[float, float]]:
    """The hand-written ``DistributedModelParallel`` loop (process group already initialised); step end stamps (``step_stamp``)."""
    import torch.distributed as dist
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    from lightning_recsys.parallel import EmbeddingOptimizerConfig, make_sharders
    from lightning_recsys.planner import make_sharding_plan

    module = TrainingLoss(pretrainer(workload))
    fused = EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=workload.table_lr).fused_params()
    sharders = make_sharders(fused, ["row_wise"])
    plan = make_sharding_plan(module, sharders, sharding_group_size=world_size, group_ranks_per_node=world_size, compute_device="cpu")
    dmp = DistributedModelParallel(module, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                   plan=plan, sharders=sharders)
    dense = [p for n, p in dmp.named_parameters() if "item_embeddings" not in n]
    optimizer = torch.optim.Adam(dense, lr=workload.dense_lr)
    batches = pretrain_batches(workload, rank, world_size, steps)
    stamps: list[tuple[float, float]] = []
    if pipelined:
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        pipeline = TrainPipelineSparseDist(dmp, optimizer, torch.device("cpu"))
        iterator = iter([_pipelineable(b) for b in batches])
        while True:
            try:
                pipeline.progress(iterator)
            except StopIteration:
                break
            stamps.append(step_stamp())
    else:
        for index, batch in enumerate(batches):
            if profile is not None:
                profile(index)
            optimizer.zero_grad()
            loss, _ = dmp(batch)
            loss.backward()
            optimizer.step()
            stamps.append(step_stamp())
    return stamps


def _pipelineable(batch: Any) -> Any:
    """A ``SequenceBatch`` as TorchRec's ``Pipelineable`` (``to``, ``record_stream``), which ``TrainPipelineSparseDist`` requires."""
    from torchrec.streamable import Pipelineable

    class PipelineableBatch(Pipelineable):
        def __init__(self, inner: Any) -> None:
            self.inner = inner
            self.sparse = inner.sparse  # record_stream's target

        def __getattr__(self, name: str) -> Any:
            # The model reads the batch's fields (sparse, timestamps, ...) by name.
            if name == "inner":  # not yet set (copy, unpickle): no recursion
                raise AttributeError(name)
            return getattr(self.inner, name)

        def to(self, device: torch.device, non_blocking: bool = False) -> "PipelineableBatch":
            return PipelineableBatch(self.inner.to(device, non_blocking=non_blocking))

        def record_stream(self, stream: Any) -> None:
            self.sparse.record_stream(stream)

    return PipelineableBatch(batch)


def lightning_fit(workload: PretrainWorkload, rank: int, world_size: int, steps: int, pipeline: str, profile: Any = None) -> list[tuple[float, float]]:
    """``Trainer.fit`` under ``TwoDRecStrategy`` on the prepared batches; step end stamps (``step_stamp``).

    ``profile(step_index)`` (a ``ProfileWindow``) is called as each step starts, and the closure
    that Lightning runs inside ``optimizer.step`` is labelled ``CLOSURE``.
    """
    from lightning.pytorch import Callback, LightningDataModule, Trainer
    from torch.utils.data import DataLoader

    from lightning_recsys import EmbeddingOptimizerConfig, PlanningConfig, TwoDRecStrategy

    class Stamps(Callback):
        def __init__(self) -> None:
            self.stamps: list[tuple[float, float]] = []

        def on_train_batch_end(self, *args: Any) -> None:
            self.stamps.append(step_stamp())

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if profile is not None:
                profile(batch_idx)

    batches = pretrain_batches(workload, rank, world_size, steps)

    class Prepared(LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(batches, batch_size=None)  # type: ignore[arg-type]

    stamps = Stamps()
    strategy = TwoDRecStrategy(
        embedding_optimizer=EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=workload.table_lr),
        planning=PlanningConfig(sharding_types=["row_wise"]),
        pipeline=pipeline,
    )
    trainer = Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[stamps],
        use_distributed_sampler=False,  # each rank's batches are its own already, as in the raw loops
    )
    model = pretrainer(workload)
    if profile is not None:
        _label_closure(model)
    trainer.fit(model, datamodule=Prepared())
    return stamps.stamps


def _label_closure(model: Any) -> None:
    """Label the training step's closure, which Lightning's ``optimizer_step`` runs inside ``optimizer.step``."""
    original = model.optimizer_step

    def optimizer_step(epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> Any:
        def closure() -> Any:
            with torch.autograd.profiler.record_function(CLOSURE):
                return optimizer_closure()

        return original(epoch, batch_idx, optimizer, closure)

    model.optimizer_step = optimizer_step


def plain_loop(workload: PretrainWorkload, steps: int, table_optimizer: str, profile: Any = None) -> list[tuple[float, float]]:
    """``PlainSASRec`` in this one process on the global batches (world size 1); step end stamps (``step_stamp``)."""
    from _plain_pretrain import PlainSASRec, plain_batch, plain_optimizers

    torch.set_num_threads(PLAIN_THREADS)
    torch.manual_seed(workload.seed)
    model = PlainSASRec(workload.num_items, workload.embedding_dim, workload.max_length, workload.num_layers,
                        workload.num_heads, dropout=workload.dropout, sparse=table_optimizer == "adagrad")
    optimizers = plain_optimizers(model, table_optimizer, table_lr=workload.table_lr, dense_lr=workload.dense_lr)
    batches = [plain_batch(b, workload.max_length) for b in pretrain_batches(workload, 0, 1, min(steps, workload.unique_batches))]
    stamps: list[tuple[float, float]] = []
    for index in range(steps):
        if profile is not None:
            profile(index)
        for optimizer in optimizers:
            optimizer.zero_grad()
        model.loss(batches[index % len(batches)]).backward()
        for optimizer in optimizers:
            optimizer.step()
        stamps.append(step_stamp())
    return stamps


def step_tokens(workload: PretrainWorkload, world_size: int, steps: int) -> list[int]:
    """Global tokens of each step (the same for every variant: the same users in the same order)."""
    per_rank = [[tokens(b) for b in pretrain_batches(workload, r, world_size, steps)] for r in range(world_size)]
    return [sum(column) for column in zip(*per_rank)]


def step_stamp() -> tuple[float, float]:
    """``(wall clock, this process's CPU time of all its threads)`` at a step's end, in seconds."""
    return time.perf_counter(), time.process_time()


def tokens_per_second(stamps: list[tuple[float, float]], step_tokens: list[int], warmup: int) -> float:
    """Tokens of the steps after ``warmup`` over their wall time (from the end of step ``warmup - 1``)."""
    if len(stamps) <= warmup or warmup < 1:
        raise ValueError(f"{len(stamps)} steps recorded; need more than warmup={warmup} (>= 1).")
    return sum(step_tokens[warmup:len(stamps)]) / (stamps[-1][0] - stamps[warmup - 1][0])


def tokens_per_cpu_second(rank_stamps: list[list[tuple[float, float]]], step_tokens: list[int], warmup: int) -> float:
    """Tokens of the steps after ``warmup`` over the CPU time every process of the run spent on them.

    On a machine shared with other jobs the wall time measures the load as much as the code; the
    CPU time a run consumes is steadier. It leaves out waiting (a rank blocked in a collective uses
    none), which on an idle machine costs wall time.
    """
    spent = sum(stamps[-1][1] - stamps[warmup - 1][1] for stamps in rank_stamps)
    return sum(step_tokens[warmup:len(rank_stamps[0])]) / spent


def mean_tokens(step_tokens: list[int]) -> float:
    return sum(step_tokens) / max(len(step_tokens), 1)


__all__ = ["BREAKDOWN_ROWS", "PRETRAIN_VARIANTS", "PretrainWorkload", "ProfileWindow", "beauty_like_lengths", "lightning_fit",
           "plain_loop", "pretrain_batches", "raw_loop", "sequence_lookup_times", "step_breakdown", "step_stamp", "step_tokens",
           "tokens", "tokens_per_cpu_second", "tokens_per_second"]


# ----------------------------------------------------------------------------- profiler breakdown
# Rows of the breakdown: each collects the ranges named here, forward, and the backward of every
# autograd node created inside them (matched by the profiler's sequence numbers).
BREAKDOWN_ROWS: dict[str, tuple[str, ...]] = {
    "lookup (fwd + bwd; TorchRec: the table's fused update too)": ("recsys:lookup", "plain:lookup"),
    "all-to-all (input dist, embeddings fwd + bwd)": ("recsys:input_dist", "recsys:embedding_all_to_all_fwd"),
    "encoder (padding, transformer; fwd + bwd)": ("pretrain:encoder", "plain:encoder"),
    "loss (scores against targets and negatives, softmax; fwd + bwd)": ("pretrain:loss", "plain:loss"),
    "dense all-reduce (DDP)": ("recsys:dense_all_reduce",),
    "batch handshake": ("recsys:batch_handshake",),
}
OPTIMIZER_ROW = "optimizer (torch optimizers' step and zero_grad)"
OTHER_ROW = "other (unlabelled: framework, autograd engine, data)"
CLOSURE = "bench:closure"  # Lightning runs forward and backward inside optimizer.step(closure): excluded from the optimizer row
_BACKWARD_PREFIX = "autograd::engine::evaluate_function: "


def _descendants(event: Any) -> Any:
    for child in event.cpu_children:
        yield child
        yield from _descendants(child)


def step_breakdown(events: Any, steps: int, wall_s: float) -> dict[str, float]:
    """Milliseconds per step by ``BREAKDOWN_ROWS`` from a profiler's ``events()`` over ``steps`` steps of ``wall_s`` seconds.

    A label's forward time is its ranges' own span; its backward time is the span of each
    ``autograd::engine::evaluate_function`` event whose sequence number belongs to an op run inside
    the label's forward ranges, less any labelled range nested in it (DDP's all-reduce hook).
    ``other`` is the step's wall time less every row.
    """
    labels = {label: row for row, names in BREAKDOWN_ROWS.items() for label in names}
    totals = dict.fromkeys([*BREAKDOWN_ROWS, OPTIMIZER_ROW], 0.0)
    owner: dict[tuple[int, int], str] = {}  # (thread, sequence number) of a forward op -> its row
    outermost = [e for e in events if e.name in labels and not _inside_label(e, labels)]
    for event in outermost:
        row = labels[event.name]
        totals[row] += event.cpu_time_total
        for inner in _descendants(event):
            if inner.sequence_nr >= 0:
                owner[(inner.thread, inner.sequence_nr)] = row
    for event in events:
        if event.name.startswith(_BACKWARD_PREFIX) and event.sequence_nr >= 0:
            forward_thread = getattr(event, "fwd_thread", None)
            row = owner.get((event.thread if forward_thread is None else forward_thread, event.sequence_nr))
            if row is not None:
                nested = sum(d.cpu_time_total for d in _descendants(event) if d.name in labels and not _inside_label(d, labels, stop=event))
                totals[row] += event.cpu_time_total - nested
        elif event.name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")) and not _inside(event, "Optimizer."):
            closure = sum(d.cpu_time_total for d in _descendants(event) if d.name == CLOSURE)
            totals[OPTIMIZER_ROW] += event.cpu_time_total - closure
    per_step = {row: value / 1e3 / steps for row, value in totals.items()}  # profiler times are in microseconds
    step_ms = wall_s * 1e3 / steps
    per_step[OTHER_ROW] = step_ms - sum(per_step.values())
    per_step["step (wall)"] = step_ms
    return per_step


def _inside(event: Any, prefix: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(prefix):
            return True
        parent = parent.cpu_parent
    return False


def _inside_label(event: Any, labels: dict[str, str], stop: Any = None) -> bool:
    parent = event.cpu_parent
    while parent is not None and parent is not stop:
        if parent.name in labels:
            return True
        parent = parent.cpu_parent
    return False


class ProfileWindow:
    """Starts ``torch.profiler`` before step ``start`` and stops it before step ``start + steps``: ``__call__(step_index)``."""

    def __init__(self, start: int, steps: int) -> None:
        self.start, self.steps = start, steps
        self.profiler: Any = None
        self.result: dict[str, float] | None = None
        self._began = 0.0

    def __call__(self, index: int) -> None:
        if index == self.start:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profiler.__enter__()
            self._began = time.perf_counter()
        elif index == self.start + self.steps and self.profiler is not None:
            wall = time.perf_counter() - self._began
            self.profiler.__exit__(None, None, None)
            self.result = step_breakdown(self.profiler.events(), self.steps, wall)
            self.profiler = None


def sequence_lookup_times(rows: int, ids: int, repeats: int = 5) -> dict[str, float]:
    """Milliseconds (median) of one forward and backward, fused row-wise Adagrad included, of FBGEMM's CPU
    table-batched embedding over ``ids`` uniform ids into a ``rows x 64`` table: ``PoolingMode.NONE``
    (sequence embeddings, as TorchRec's ``BatchedFusedEmbedding`` builds it) and ``PoolingMode.SUM``
    with one id per bag (the same rows out, the same update)."""
    import statistics

    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen

    torch.set_num_threads(1)  # as each TorchRec rank runs
    torch.manual_seed(0)
    indices, offsets, grad = torch.randint(0, rows, (ids,)), torch.arange(ids + 1), torch.randn(ids, 64)
    times = {}
    for name, pooling in (("none", PoolingMode.NONE), ("sum_one_id_per_bag", PoolingMode.SUM)):
        table = SplitTableBatchedEmbeddingBagsCodegen(
            [(rows, 64, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            learning_rate=0.05, pooling_mode=pooling,
        )
        spent = []
        for _ in range(repeats + 1):  # the first is warm-up
            began = time.perf_counter()
            table(indices, offsets).backward(grad)
            spent.append(1e3 * (time.perf_counter() - began))
        times[name] = statistics.median(spent[1:])
    return times
