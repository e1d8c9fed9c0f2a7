"""How ``TwoDRecStrategy`` hands batches to Lightning: checked, agreed between ranks and pipelined."""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.trainer.states import RunningStage
from typing_extensions import override

from lightning_recsys.parallel.input import CoordinatedBatches, SparseDistPipeline
from lightning_recsys.strategies.lightning_hooks import batch_hooks_after_the_check


class CoordinatedBatchHooks:
    """Wraps every dataloader in ``CoordinatedBatches``: the input check, the per-batch handshake between
    ranks (skip and stop rules) and, with ``pipeline="sparse_dist"``, the next batch's input distribution."""

    _coordination_group: Any
    _setup: Any
    _input_pipeline: Optional[SparseDistPipeline]
    pipeline: str
    guard: Any
    lightning_module: Any
    sharded_model: Any
    root_device: Any
    _stop_requests: Any
    _stop_on_every_rank: Any

    @override
    def process_dataloader(self, dataloader: object) -> object:
        if self._coordination_group is None or self._setup is None:
            return dataloader
        dmp = self.sharded_model.dmp
        if self.pipeline == "sparse_dist" and self._input_pipeline is None:
            self._input_pipeline = SparseDistPipeline(dmp, self.root_device)
        return CoordinatedBatches(
            dataloader,  # type: ignore[arg-type]
            group=self._coordination_group,
            validator=self._setup.input_validator,
            validate=self.guard.validate_inputs,
            equal_sizes_required=self._setup.equal_batch_sizes_required and not self._forward_only(),
            pipeline=self._input_pipeline,
            training=lambda: self.lightning_module is not None and self.lightning_module.training,
            progress=self._epoch_progress,
            stop_requested=self._stop_requests,
            on_stop=self._stop_on_every_rank,
            checked_before=batch_hooks_after_the_check(self.lightning_module),
        )

    def _forward_only(self) -> bool:
        # Validation, test and predict run no backward, and without one TorchRec's reduce-scatter takes unequal
        # sizes (input_splits). Skipping their uneven batches lost examples: a map-style predict dataset's unequal
        # shares (Lightning's unrepeated predict sampler), or users of a full ranking whose last batch splits 2 and 3.
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        stage = trainer.state.stage if trainer is not None else None
        return stage is not None and (stage.evaluating or stage == RunningStage.PREDICTING)

    def _epoch_progress(self) -> tuple[int, bool]:
        """Training steps run in this epoch (their updates are in the model) and whether the loop counts it complete."""
        trainer = self.lightning_module.trainer
        steps = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return steps, steps >= trainer.num_training_batches
