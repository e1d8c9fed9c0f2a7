"""DCPCheckpointIO: Lightning's CheckpointIO over the Trainer-free DCP layer in ``lightning_recsys.checkpoint``."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_recsys.checkpoint import (
    AsyncCheckpointHandle,
    AsyncCheckpointSaver,
    CheckpointMismatchError,
    ShardedState,
    load_checkpoint,
    read_meta,
    save_checkpoint,
)
from lightning_recsys.checkpoint.directory import checkpoint_path
from lightning_recsys.checkpoint.host_state_checks import drop_foreign_checkpoint_paths
from lightning_recsys.checkpoint.removal import remove_checkpoint
from lightning_recsys.checkpoint.safe_reading import require_trusted_bool
from lightning_recsys.parallel.topology import ParallelTopology


class ShardedCheckpointSource(Protocol):
    """What the plugin needs from the strategy: this rank's sharded state and the rank layout."""

    topology: ParallelTopology
    collective_timeout: timedelta  # bounds the background writes' collectives too

    def sharded_checkpoint_state(self) -> ShardedState: ...

    def load_strictly(self) -> bool: ...

    def restores_optimizer_state(self) -> bool: ...

    def checkpoint_folders(self) -> Optional[list[str]]: ...


class DCPCheckpointIO(CheckpointIO):
    """Sharded checkpoints with PyTorch Distributed Checkpoint, written and read on every rank.

    A checkpoint is a directory (see docs/checkpoints.md): DCP shards of the model and the
    embedding optimizer state, written by one replica's sharding group; the rest of Lightning's
    checkpoint (loops, callbacks, dense optimizers, schedulers, hyperparameters) from rank 0; and
    ``meta.json``. It is committed atomically, and loads into any world size, sharding group size and
    plan. ``TwoDRecStrategy`` uses it by default and calls it on every rank (Lightning's base
    strategy calls CheckpointIO on rank 0 only, which would keep only rank 0's shards).

    Args:
        async_save: write in the background with DCP's ``async_save``; the save returns once the
            state is copied to CPU memory, and is committed at the next save or at teardown (a save
            after teardown is committed before it returns).
        trusted: load checkpoints with DCP's own unrestricted unpickling. By default a load runs no
            code from the checkpoint: its index and non-tensor items may hold only the classes DCP
            writes (see docs/checkpoints.md, Security), anything else raises ``UnsafeCheckpointError``.
            Set it only for a checkpoint you trust as you would trust code.
    """

    def __init__(self, async_save: bool = False, trusted: bool = False) -> None:
        require_trusted_bool(trusted)
        self.async_save = async_save
        self.trusted = trusted
        self._source: Optional[ShardedCheckpointSource] = None
        self._saver: Optional[AsyncCheckpointSaver] = None
        self._pending: Optional[AsyncCheckpointHandle] = None
        self._torn_down = False

    def connect(self, source: ShardedCheckpointSource) -> None:
        """Called by the strategy after sharding, on every rank (collective when ``async_save``)."""
        self._source = source
        self._torn_down = False
        if self.async_save and self._saver is None:
            self._saver = AsyncCheckpointSaver(source.topology, timeout=source.collective_timeout)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"DCPCheckpointIO.save_checkpoint does not take storage_options (got {storage_options!r}).")
        source = self._require_source("save")
        host_state = {k: v for k, v in checkpoint.items() if k != "state_dict"}
        kwargs: dict[str, Any] = {
            "state": source.sharded_checkpoint_state(),
            "host_state": host_state,
            "step": checkpoint.get("global_step"),
            "extra_meta": {"epoch": checkpoint.get("epoch")},
        }
        if self._saver is None:
            save_checkpoint(path, topology=source.topology, **kwargs)
            return
        self.wait()
        self._pending = self._saver.save(path, **kwargs)
        if self._torn_down:
            # After teardown (trainer.save_checkpoint after fit, on_fit_end) no later save or teardown
            # would commit it: the checkpoint would be lost silently. Commit now.
            self.wait()

    @override
    def load_checkpoint(
        self, path: _PATH, map_location: Optional[Callable] = None, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        """Load the sharded state in place (resharding as needed) and return the rest of the checkpoint."""
        # Lightning hands ckpt_path on as it was given; name it, not pathlib's "expected str, bytes or os.PathLike".
        path = checkpoint_path(path, argument="ckpt_path", also=", or 'last', 'best' or 'hpc'")
        source = self._require_source("load")
        self.wait()
        state = source.sharded_checkpoint_state()
        try:
            loaded = load_checkpoint(
                path,
                state=state,
                topology=source.topology,
                strict=source.load_strictly(),
                # validate/test/predict have no optimizers to restore (data-parallel tables get none then)
                load_embedding_optimizer_state=source.restores_optimizer_state(),
                weights_only=weights_only,
                require_host_state=True,
                trusted=self.trusted,
            )
        except CheckpointMismatchError as error:
            # Its remedies name load_checkpoint()'s arguments, which a Trainer call cannot pass.
            remedies = _trainer_remedies(path, state.embedding_optimizer.name, error)
            raise CheckpointMismatchError(f"{error}\n{remedies}" if remedies else str(error), error.kinds) from error
        assert loaded.host_state is not None
        dropped = drop_foreign_checkpoint_paths(loaded.host_state)
        if dropped:
            # Lightning would restore them into ModelCheckpoint and later delete "the previous best" by that path.
            rank_zero_warn(
                f"DCPCheckpointIO: the checkpoint {path} names checkpoint paths outside its callback's folder "
                f"({'; '.join(dropped[:5])}); they were dropped, so ModelCheckpoint starts its top-k list afresh."
            )
        data = "" if loaded.path.name == path.name else f" (data directory {loaded.path.name}, the newest committed copy of that name)"
        rank_zero_info(
            f"DCPCheckpointIO: loaded the committed checkpoint {path}{data} at step {loaded.meta.step}, "
            f"epoch {loaded.meta.extra.get('epoch')}, saved {loaded.meta.saved_at} by {loaded.meta.world_size} ranks"
        )
        return dict(loaded.host_state)

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        """Delete the name, the data directory it points to, and that name's leftovers of interrupted saves.

        Only a committed checkpoint of this package, inside a folder of the Trainer's checkpoint callbacks
        (when the strategy knows them), is removed; anything else is skipped with one warning naming it.
        """
        folders = None
        if self._source is not None and hasattr(self._source, "checkpoint_folders"):
            folders = self._source.checkpoint_folders()
        remove_checkpoint(path, folders=folders)

    def wait(self) -> Optional[Path]:
        """Commit the pending background save, if any (collective: every rank)."""
        pending, self._pending = self._pending, None
        return pending.wait() if pending is not None else None

    @override
    def teardown(self) -> None:
        self.wait()
        self._torn_down = True

    def _require_source(self, action: str) -> ShardedCheckpointSource:
        if self._source is None:
            raise RuntimeError(
                f"DCPCheckpointIO cannot {action} a checkpoint before TwoDRecStrategy has sharded the model; "
                "use it as TwoDRecStrategy's checkpoint_io (the default), not with another strategy."
            )
        return self._source


_WEIGHTS_ONLY = (
    "start a new fit from its weights only (build the model with real, not meta, tables, "
    "lightning_recsys.checkpoint.load_unsharded(path, model), then fit without ckpt_path). "
    "validate/test/predict(ckpt_path=...) read the weights only."
)


def _trainer_remedies(path: Any, optimizer: str, error: CheckpointMismatchError) -> str:
    """What a Trainer user can do about ``error`` (the Trainer-free remedies are arguments); "" if nothing applies."""
    try:
        saved = read_meta(path).embedding_optimizer.get("name")
    except Exception:  # noqa: BLE001 - only for the message
        saved = None
    lines = []
    # strict_loading = False skips only keys on one side; saying it for a resized table or missing
    # optimizer state sent users to a setting that fails the same way.
    if error.strict_false_skips:
        lines.append("Under a Trainer: strict=False is the LightningModule's `strict_loading = False`.")
    other_optimizer = saved is not None and saved != optimizer
    if error.optimizer_state or other_optimizer:
        if not lines:
            lines.append("Under a Trainer:")
        lines.append(
            "`strict_loading = False` does not skip embedding optimizer state, and fit(ckpt_path=...) restores it "
            "(load_embedding_optimizer_state is not a Trainer argument):"
        )
        if other_optimizer:
            lines.append(
                f"the checkpoint's embedding optimizer is {saved!r}, this strategy's {optimizer!r}: resume with "
                f"EmbeddingOptimizerConfig(name={saved!r}), or {_WEIGHTS_ONLY}"
            )
        else:
            lines.append(_WEIGHTS_ONLY)
    return " ".join(lines)
