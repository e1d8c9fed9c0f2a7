"""Lightning callbacks: what TwoDRecStrategy measured (CommunicationMonitor, RunSummary) and a warm start (InitFromCheckpoint)."""

from __future__ import annotations

import json
import os
import resource
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_recsys.checkpoint.warm_start import WarmStartResult, load_weights, load_weights_unsharded
from lightning_recsys.contracts.warm_start import WARM_START_ROLES, WarmStartable, WarmStartPart
from lightning_recsys.parallel.input import CoordinatedBatches
from lightning_recsys.strategies import TwoDRecStrategy


class CommunicationMonitor(Callback):
    """Logs the bytes each collective moved in the training step, as ``comm/<purpose>/<op>/<group>/bytes``.

    Also logs ``comm/inter_node_bytes`` and ``comm/intra_node_bytes``. The numbers are this rank's
    (the logger writes rank 0's); see ``lightning_recsys.parallel.comms.comm_accounting`` for what is counted.

    Args:
        logging_interval: log every this many training steps (default: every step).
    """

    def __init__(self, logging_interval: int = 1) -> None:
        if logging_interval < 1:
            raise ValueError(f"CommunicationMonitor(logging_interval={logging_interval}) must be >= 1.")
        self.logging_interval = logging_interval

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not isinstance(trainer.strategy, TwoDRecStrategy):
            raise MisconfigurationException(
                f"CommunicationMonitor needs strategy=TwoDRecStrategy(...); got {type(trainer.strategy).__name__}."
            )

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step % self.logging_interval:
            return
        strategy = trainer.strategy
        assert isinstance(strategy, TwoDRecStrategy)
        pl_module.log_dict(strategy.comm_accounting.as_metrics(), on_step=True, on_epoch=False)


class RunSummary(Callback):
    """Measures the training steps and, at the end of ``fit``, prints a short summary (rank 0).

    The summary has examples per second (wall clock from the end of one training step to the end
    of the next, so data loading and the batch handshake count; validation does not), the step
    time split into forward, backward and optimizer (the fused embedding update happens inside
    backward; the replica sync counts as optimizer), the bytes per step from the communication
    accounting, peak memory, and the final metrics. On CUDA every step end synchronizes the device,
    so the clock sees the kernels, not just their launch. Communication time is not split out: TorchRec's collectives are asynchronous and
    overlap the compute around them, so their time sits inside forward and backward. The summary's
    examples count every rank's batches (one all-gather at the end of training), so ranks with
    unequal batch sizes are counted right; the progress bar's live ``examples_per_sec`` assumes this
    rank's batch size on every rank.

    It also says what the run did not train on, where that is known: the steps the batch handshake
    of ``TwoDRecStrategy`` skipped on every rank and the batches it dropped at uneven epoch ends,
    and each rank's malformed input lines its train dataset skipped (a ``skipped_lines`` count).

    Args:
        json_path: also write the summary to this file (rank 0).
        warmup_steps: the first steps of each fit (a resumed one too) left out of the timing averages
            (they pay for setup).
    """

    def __init__(self, json_path: str | None = None, warmup_steps: int = 2) -> None:
        if warmup_steps < 0:
            raise ValueError(f"RunSummary(warmup_steps={warmup_steps}) must be >= 0.")
        self.json_path = json_path
        self.warmup_steps = warmup_steps
        self.summary: dict[str, Any] = {}
        self._reset()

    def _reset(self) -> None:
        self._marks: dict[str, float] = {}
        self._totals = {"step": 0.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        self._fit_steps = 0  # steps of this fit: a resumed fit starts at a global step > 0
        self._timed_steps = 0
        self._timed_local_examples = 0  # this rank's batches; every rank's are summed at the end of training
        self._timed_examples = 0
        self._wall_seconds = 0.0
        self._loader: CoordinatedBatches | None = None  # the train loader's handshake counts, banked when it is replaced
        self._banked = (0, 0)
        self._handshake: tuple[int, int] | None = None  # (skipped steps, dropped batches)
        self._skipped_lines_by_rank: list[int | None] | None = None
        self._validated_at_step: int | None = None
        self._last_step_end: float | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._reset()  # the summary describes this fit, not an earlier one with the same callback

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._marks = {"start": time.perf_counter()}

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Any) -> None:
        self._marks["forward_end"] = time.perf_counter()

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._marks["backward_end"] = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        marks = self._marks
        if "start" not in marks or "backward_end" not in marks:
            return  # a skipped step (no backward ran)
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        end = time.perf_counter()
        self._fit_steps += 1
        previous_end, self._last_step_end = self._last_step_end, end
        step_time = end - marks["start"]
        local = int(getattr(batch, "batch_size", 0))
        examples = local * trainer.world_size  # the live estimate; the summary sums every rank's at the end
        wall = end - previous_end if previous_end is not None else None
        if wall and examples:
            pl_module.log("examples_per_sec", examples / wall, prog_bar=True, on_step=True, on_epoch=False, logger=False)
        if self._fit_steps <= self.warmup_steps or wall is None:
            return
        self._timed_steps += 1
        self._timed_local_examples += local
        self._wall_seconds += wall
        self._totals["step"] += step_time
        self._totals["forward"] += marks["forward_end"] - marks["start"]
        self._totals["backward"] += marks["backward_end"] - marks["forward_end"]
        self._totals["optimizer"] += end - marks["backward_end"]

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._note_handshake(trainer)  # a loader reloaded for the next epoch starts its counts again

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Here, not in on_fit_end: that runs after the strategy's teardown, without the process group.
        self._note_handshake(trainer)
        skipped = _skipped_lines(trainer.train_dataloader)
        mine = torch.tensor(
            [self._timed_local_examples, -1 if skipped is None else skipped], dtype=torch.int64, device=trainer.strategy.root_device
        )
        gathered = trainer.strategy.all_gather(mine) if trainer.world_size > 1 else mine
        rows = gathered.reshape(-1, 2).tolist()
        self._timed_examples = sum(examples for examples, _ in rows)
        if any(lines >= 0 for _, lines in rows):
            self._skipped_lines_by_rank = [lines if lines >= 0 else None for _, lines in rows]

    def _note_handshake(self, trainer: Trainer) -> None:
        loader = trainer.train_dataloader
        if not isinstance(loader, CoordinatedBatches):
            return
        if self._loader is not None and loader is not self._loader:
            self._banked = (self._banked[0] + self._loader.skipped_steps, self._banked[1] + self._loader.dropped_batches)
        self._loader = loader
        self._handshake = (self._banked[0] + loader.skipped_steps, self._banked[1] + loader.dropped_batches)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_step_end = None  # the next step's interval would include validation

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._validated_at_step = trainer.global_step  # the val/ metrics describe the model of this step

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.summary = self._build(trainer)
        self._loader = None  # let the loader go with the fit
        if not trainer.is_global_zero:
            return
        print(format_summary(self.summary))
        if self.json_path:
            with open(self.json_path, "w") as f:
                json.dump(self.summary, f, indent=2)

    def _build(self, trainer: Trainer) -> dict[str, Any]:
        steps = self._timed_steps
        per_step_ms = {k: 1000 * v / steps for k, v in self._totals.items()} if steps else {}
        summary: dict[str, Any] = {
            "world_size": trainer.world_size,
            "global_steps": trainer.global_step,
            "timed_steps": steps,
            "examples_per_sec": self._timed_examples / self._wall_seconds if steps and self._wall_seconds else None,
            "examples_timed": self._timed_examples,  # every rank's batches in the timed steps
            "wall_seconds_timed": self._wall_seconds,
            "step_time_ms": per_step_ms.get("step"),
            "forward_ms": per_step_ms.get("forward"),
            "backward_ms": per_step_ms.get("backward"),
            "optimizer_ms": per_step_ms.get("optimizer"),
            "communication_ms": None,  # asynchronous collectives overlap compute; see the bytes instead
            "peak_memory_mib": _peak_memory_mib(trainer.strategy.root_device),
            "metrics": {
                k: float(v) for k, v in sorted(trainer.callback_metrics.items()) if v.numel() == 1 and k != "examples_per_sec"
            },
            "val_metrics_step": self._validated_at_step,
        }
        if self._handshake is not None:  # TwoDRecStrategy's batch handshake: the same counts on every rank
            summary["skipped_steps"], summary["dropped_batches"] = self._handshake
        if self._skipped_lines_by_rank is not None:
            summary["skipped_input_lines_by_rank"] = self._skipped_lines_by_rank
        strategy = trainer.strategy
        if isinstance(strategy, TwoDRecStrategy):
            accounting = strategy.comm_accounting
            payload, inter = accounting.bytes_by()
            summary["bytes_per_step"] = {"payload": payload, "inter_node": inter}
            summary["bytes_per_step_by_purpose"] = {
                purpose: accounting.bytes_by(purpose=purpose)[0]
                for purpose in sorted({key.purpose for key in accounting.last_step})
            }
            lookup = accounting.lookup_split()
            if lookup:  # the sequence all-to-all by feature: this rank's lookups' embeddings and gradients
                summary["sequence_all_to_all_by_feature"] = {
                    feature: {direction: {"payload": p, "inter_node": i} for direction, (p, i) in parts.items()}
                    for feature, parts in lookup.items()
                }
            summary["qcomms"] = {c: list(p) for c, p in strategy.effective_qcomms.precisions.items()}
            totals = strategy.runtime.sync_totals
            if totals is not None:  # 2D: this rank's replica syncs
                summary["replica_sync"] = {
                    "syncs": totals.syncs,
                    "rows_per_sync": totals.rows_per_sync,
                    "rows_total": totals.rows_total,
                    "touched_fraction": totals.touched_fraction,
                    "bytes_per_sync": totals.bytes_per_sync,
                }
            elif strategy.runtime.nothing_to_sync:  # 2D, every table data_parallel: no sync ran, none was needed
                summary["replica_sync"] = None
        return summary


class InitFromCheckpoint(Callback):
    """Warm start: at the start of ``fit``, copy chosen tables and dense submodules from another model's checkpoint.

    The checkpoint is a DCP directory of this package (any LightningModule's, e.g. a
    ``SequencePretrainer``'s ``last.ckpt``) or a safetensors export of one
    (``lightning_recsys.checkpoint.export_safetensors``). Only weights are read: no optimizer state,
    no step counters, no callbacks; the fit starts at step 0 with fresh optimizers. Under
    ``TwoDRecStrategy`` every rank reads its own shards after sharding, re-cut for this run's world
    size and plan (1D or 2D); another strategy loads the whole weights in each process. Every rank
    checks every pick (the name exists in the model, the global shapes agree) before anything is
    read, and a problem raises on every rank: ``CheckpointMismatchError`` naming each table or
    parameter with both shapes, ``ValueError`` for an ``include`` pattern that matches nothing or a
    name the model lacks.

    It loads after Lightning restored a checkpoint, before the sanity check (else before the first
    training batch): a resumed fit (``fit(ckpt_path=...)``, ``trainer.ckpt_path`` set) keeps the
    resumed state and skips the warm start, with one INFO line saying so; so does a later ``fit`` of
    the same model with the same callback (it would overwrite what the earlier fit trained).

    By role: ``parts=["encoder", "item_table"]`` loads the model's encoder and item table from the
    checkpoint's, wherever each model holds them (``contracts.warm_start``: a model's
    ``warm_start_parts()``, which its checkpoints record), e.g. a ``SequenceRanker`` with a causal encoder
    from a ``SequencePretrainer``. A part that does not fit is named with how: missing in the checkpoint,
    another kind of encoder (``CheckpointMismatchError``), other tensors (e.g. another number of layers),
    other shapes.

    On the command line: ``--trainer.callbacks+=lightning_recsys.callbacks.InitFromCheckpoint
    --trainer.callbacks.path CKPT --trainer.callbacks.parts '[encoder, item_table]'`` (or
    ``--trainer.callbacks.include '[encoder.*]'`` to pick by key).

    Args:
        path: the checkpoint directory (or its name; the newest committed copy is read) or a ``.safetensors`` file.
        parts: the roles to load (``"encoder"``, ``"item_table"``), in place of ``include`` and ``rename``; the
            model must state its parts (``warm_start_parts``). A safetensors export records no parts: each is
            then read where the model holds it.
        include: ``fnmatch`` patterns over the checkpoint's state-dict keys (its module's
            ``state_dict()`` names, e.g. ``"encoder.*"`` or ``"item_embeddings.embeddings.item.weight"``);
            default every tensor of the checkpoint. Each pattern must match at least one.
        rename: checkpoint key prefix -> model key prefix, e.g. ``{"item_embeddings.": "sequence_embeddings."}``
            (the longest matching prefix applies); default none.
        trusted: read the checkpoint's index and byte items without the restricted unpickler, as
            ``DCPCheckpointIO(trusted=True)`` does (only for a checkpoint you trust as you trust code); default off.
    """

    def __init__(
        self,
        path: str,
        include: list[str] | None = None,
        rename: dict[str, str] | None = None,
        trusted: bool = False,
        parts: list[str] | None = None,
    ) -> None:
        if parts is not None:
            if isinstance(parts, str) or not list(parts) or not all(isinstance(p, str) for p in parts) or len(set(parts)) != len(parts):
                raise ValueError(
                    f"InitFromCheckpoint(parts={parts!r}) must be a non-empty list of distinct roles, e.g. {list(WARM_START_ROLES)}."
                )
            if include is not None or rename is not None:
                raise ValueError(
                    f"InitFromCheckpoint(parts={parts!r}) picks by role; include={include!r} and rename={rename!r} pick by key. "
                    "Give one or the other."
                )
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ValueError(f"InitFromCheckpoint(path={path!r}) must be a checkpoint directory or a .safetensors file.")
        if include is not None and (
            isinstance(include, str) or not all(isinstance(p, str) and p for p in include) or not list(include)
        ):
            raise ValueError(
                f"InitFromCheckpoint(include={include!r}) must be a non-empty list of fnmatch patterns (non-empty strings), "
                "e.g. ['encoder.*'], or None for every tensor of the checkpoint."
            )
        if rename is not None and (
            not isinstance(rename, dict) or not all(isinstance(k, str) and k and isinstance(v, str) for k, v in rename.items())
        ):
            raise ValueError(
                f"InitFromCheckpoint(rename={rename!r}) must map checkpoint key prefixes (non-empty strings) to model key "
                "prefixes, e.g. {'item_embeddings.': 'sequence_embeddings.'}."
            )
        if not isinstance(trusted, bool):
            raise ValueError(f"InitFromCheckpoint(trusted={trusted!r}) must be True or False (False: the restricted reader).")
        self.path = str(path)
        self.trusted = trusted
        self.include = None if include is None else list(include)
        self.rename = None if rename is None else dict(rename)
        self.parts = None if parts is None else list(parts)
        self.result: WarmStartResult | None = None
        self._pending = False
        self._loaded_into: int | None = None  # id() of the module warm-started by an earlier fit

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning restores fit(ckpt_path=...) after on_fit_start (TwoDRecStrategy restores after setup), so
        # whether this fit resumes is known only in the next hooks.
        self._pending = True
        self.result = None

    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._warm_start(trainer, pl_module)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._warm_start(trainer, pl_module)

    def _warm_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._pending:
            return
        self._pending = False
        if trainer.ckpt_path is not None:
            rank_zero_info(
                f"InitFromCheckpoint: skipped the warm start from {self.path}: this fit resumed from {trainer.ckpt_path}, "
                "whose state wins."
            )
            return
        if self._loaded_into == id(pl_module):
            rank_zero_info(f"InitFromCheckpoint: skipped the warm start from {self.path}: an earlier fit already loaded it into this model.")
            return
        strategy = trainer.strategy
        parts = self._model_parts(pl_module)
        if isinstance(strategy, TwoDRecStrategy):
            self.result = load_weights(
                self.path, state=strategy.sharded_checkpoint_state(), topology=strategy.topology, include=self.include, rename=self.rename,
                trusted=self.trusted, parts=parts,
            )
            strategy.runtime.restart_sync_cadence()  # every replica loaded the same values
        else:
            self.result = load_weights_unsharded(
                self.path, pl_module, include=self.include, rename=self.rename, trusted=self.trusted, parts=parts
            )
        self._loaded_into = id(pl_module)
        into = f" into {strategy.topology.describe()}" if isinstance(strategy, TwoDRecStrategy) else ""
        saved_by = f" (saved by {self.result.saved_by})" if self.result.saved_by else ""
        rank_zero_info(f"InitFromCheckpoint: loaded {len(self.result.loaded)} tensors from {self.result.path}{saved_by}{into}")


    def _model_parts(self, pl_module: LightningModule) -> dict[str, WarmStartPart] | None:
        """The model's part of each role in ``parts`` (None without ``parts``); ``ValueError`` naming a role it lacks."""
        if self.parts is None:
            return None
        if not isinstance(pl_module, WarmStartable):
            raise ValueError(
                f"InitFromCheckpoint(parts={self.parts}): {type(pl_module).__name__} states no warm-start parts "
                "(warm_start_parts(), lightning_recsys.contracts.warm_start); pick tensors by key with include= instead."
            )
        own = dict(pl_module.warm_start_parts())
        lacking = [role for role in self.parts if role not in own]
        if lacking:
            raise ValueError(
                f"InitFromCheckpoint(parts={self.parts}): {type(pl_module).__name__} has no {lacking} part; it has {sorted(own)}."
            )
        return {role: own[role] for role in self.parts}


def format_summary(summary: dict[str, Any]) -> str:
    """The run summary as a two-column table."""

    def fmt(value: Any) -> str:
        if value is None:
            return "n/a"
        return f"{value:,.4g}" if isinstance(value, float) else str(value)

    rows = [
        ("ranks", fmt(summary["world_size"])),
        ("steps (timed)", f"{summary['global_steps']} ({summary['timed_steps']})"),
        ("examples/s", fmt(summary["examples_per_sec"])),
        *([("examples (timed, all ranks)", f"{summary['examples_timed']:,}")] if "examples_timed" in summary else []),
        ("step time (ms)", fmt(summary["step_time_ms"])),
        ("  forward", fmt(summary["forward_ms"])),
        ("  backward (incl. fused embedding update)", fmt(summary["backward_ms"])),
        ("  optimizer (incl. replica sync)", fmt(summary["optimizer_ms"])),
        ("  communication", "overlapped; see bytes"),
        ("peak memory (MiB)", fmt(summary["peak_memory_mib"])),
    ]
    if "bytes_per_step" in summary:
        rows.append(("bytes/step (inter-node)", f"{summary['bytes_per_step']['payload']:,} ({summary['bytes_per_step']['inter_node']:,})"))
        rows += [(f"  {purpose}", f"{value:,}") for purpose, value in summary["bytes_per_step_by_purpose"].items()]
    if "sequence_all_to_all_by_feature" in summary:
        rows.append(("sequence all-to-all by feature", "embeddings in + gradients out (inter-node)"))
        rows += [
            (f"  {feature}", " + ".join(f"{parts[d]['payload']:,}" for d in ("embeddings", "gradients") if d in parts)
             + f" ({sum(p['inter_node'] for p in parts.values()):,})")
            for feature, parts in summary["sequence_all_to_all_by_feature"].items()
        ]  # fmt: skip
    if "replica_sync" in summary and summary["replica_sync"] is None:
        rows.append(("replica syncs", "none (every table is data_parallel: nothing to sync)"))
    elif "replica_sync" in summary:
        sync = summary["replica_sync"]
        rows.append(("replica syncs (rank 0)", f"{sync['syncs']:,}"))
        rows.append(("  rows per sync (touched fraction)", f"{sync['rows_per_sync']:,.0f} of {sync['rows_total']:,} ({sync['touched_fraction']:.2%})"))
        rows.append(("  bytes per sync", f"{sync['bytes_per_sync']:,.0f}"))
    if "skipped_steps" in summary:
        rows.append(("steps skipped (empty or unequal batches)", f"{summary['skipped_steps']:,}"))
        rows.append(("batches dropped (uneven epoch ends)", f"{summary['dropped_batches']:,}"))
    if "skipped_input_lines_by_rank" in summary:
        rows.append(("malformed input lines skipped", _describe_by_rank(summary["skipped_input_lines_by_rank"])))
    validated = summary.get("val_metrics_step")
    rows += [
        (name, fmt(value) + (f" (step {validated})" if name.startswith("val/") and validated is not None else ""))
        for name, value in summary["metrics"].items()
    ]
    width = max(len(name) for name, _ in rows)
    return "Run summary\n" + "\n".join(f"  {name.ljust(width)}  {value}" for name, value in rows)


def _describe_by_rank(counts: list[int | None]) -> str:
    """``3 on every rank``, or the total and each rank's count (``n/a``: that rank's dataset counts none)."""
    if None not in counts and len(set(counts)) == 1:
        return f"{counts[0]:,} on every rank"
    known = [c for c in counts if c is not None]
    ranks = ", ".join("n/a" if c is None else f"{c:,}" for c in counts)
    return f"{sum(known):,} in all (by rank: {ranks})" if len(counts) <= 8 else f"{sum(known):,} in all ({min(known):,} to {max(known):,} per rank)"


def _skipped_lines(loader: Any) -> int | None:
    """The train dataset's ``skipped_lines`` (malformed lines its reader skipped), if it counts them."""
    count = getattr(getattr(loader, "dataset", None), "skipped_lines", None)
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def _peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
