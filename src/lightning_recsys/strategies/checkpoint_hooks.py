"""How ``TwoDRecStrategy`` saves and loads: every rank writes and reads its own shards through DCP."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Optional

from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_recsys.checkpoint import ShardedState
from lightning_recsys.parallel.sharding import RESHAPE_CHECKPOINT_KEY, reshape_record
from lightning_recsys.strategies.checkpoint_io import DCPCheckpointIO

_NO_LAST_CHECKPOINT_YET = r'\.fit\(ckpt_path="last"\) is set, but there is no last checkpoint available'


def silence_no_last_checkpoint_yet() -> None:
    """fit(ckpt_path="last") before the first checkpoint is the restart recipe's first start, not a mistake.

    Lightning's ``_CheckpointConnector._parse_ckpt_path`` warns about it before any strategy hook
    runs; ``on_train_start`` says it in one INFO line instead."""
    warnings.filterwarnings("ignore", message=_NO_LAST_CHECKPOINT_YET)


class ShardedCheckpointHooks:
    """The strategy's checkpoint hooks; ``DCPCheckpointIO`` reads ``sharded_checkpoint_state`` and the rest.

    Lightning's base strategy saves through CheckpointIO on rank 0 only, and loads before setup;
    sharded tables need every rank, after setup.
    """

    _checkpoint_io: Optional[CheckpointIO]
    lightning_module: Any
    runtime: Any
    sharded_model: Any
    embedding_optimizer_config: Any
    data_parallel_table_optimizer: Any

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = DCPCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:
        self._checkpoint_io = io

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # The sharded tables (and the data-parallel table optimizer) exist only after setup.
        return True

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Every rank writes its shards (Lightning's base strategy would call CheckpointIO on rank 0 only)."""
        self._sync_before_save()  # replicas agree (optimizer state too), so the one that writes speaks for all
        record = reshape_record(self.lightning_module) if self.lightning_module is not None else []
        if record:  # reshape_tables=True: what an unsharded model needs to load it (load_unsharded, load_from_checkpoint)
            checkpoint = {**checkpoint, RESHAPE_CHECKPOINT_KEY: record}
        self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Every rank loads its (re-cut) shards in place; returns the rest of the checkpoint."""
        checkpoint = self.checkpoint_io.load_checkpoint(checkpoint_path, weights_only=weights_only)
        self.runtime.restart_sync_cadence()  # every replica loaded the same state
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if "state_dict" in checkpoint:  # a plain (non-DCP) checkpoint dict
            super().load_model_state_dict(checkpoint, strict=strict)
        # else: DCPCheckpointIO already loaded the model in place

    def on_train_start(self) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None:
            return
        fit_loop = trainer.fit_loop
        if fit_loop.restarted_mid_epoch and fit_loop.epoch_loop.restarted_on_train_batch_end and fit_loop.epoch_loop.batch_progress.is_last_batch:
            # Workaround (Lightning 2.6, loops/fit_loop.py): resuming from a checkpoint saved at an epoch's last batch,
            # _FitLoop.reset() counts that epoch complete but keeps RESTARTED_MID_EPOCH, so on_advance_start skips the
            # next epoch's increment_ready/started (and on_train_epoch_start); a checkpoint saved in that epoch then
            # resumes it from its first batch, training those batches twice.
            fit_loop.reset_restart_stage()
        if trainer.ckpt_path is None and trainer.global_step == 0:
            rank_zero_info(
                "TwoDRecStrategy: fit starts fresh at step 0: no checkpoint to resume from (none was given, or "
                'ckpt_path="last" found no committed one yet).'
            )

    def sharded_checkpoint_state(self) -> ShardedState:
        """This rank's state for DCP: the module's state dict and the embedding optimizer state."""
        return ShardedState(
            model_state_dict=self.lightning_module.state_dict(),  # type: ignore[union-attr]
            sharded_model=self.sharded_model,
            embedding_optimizer=self.embedding_optimizer_config,
            data_parallel_table_optimizer=self.data_parallel_table_optimizer,
        )

    def checkpoint_folders(self) -> Optional[list[str]]:
        """The folders of the Trainer's checkpoint callbacks: the only places a checkpoint is removed from (None: unknown)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None:
            return None
        folders = [str(cb.dirpath) for cb in getattr(trainer, "checkpoint_callbacks", []) if getattr(cb, "dirpath", None)]
        return folders or None

    def load_strictly(self) -> bool:
        return bool(getattr(self.lightning_module, "strict_loading", True))

    def restores_optimizer_state(self) -> bool:
        """Only ``fit`` restores optimizer state; evaluation needs the weights alone."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return trainer is not None and trainer.state.fn == TrainerFn.FITTING
