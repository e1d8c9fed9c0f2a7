"""``GuardConfig``: what the strategy checks every step before and after the update."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_recsys.parallel.input.batch_check import VALIDATE_INPUTS, ValidateInputs


@dataclass(kw_only=True, frozen=True)
class GuardConfig:
    """The per-step guards; whatever one rank finds, every rank raises together.

    Args:
        validate_inputs: check every batch's sparse ids, keys, lengths and weights against the
            tables before the step: ``"error"`` (default) stops every rank with the feature, table,
            id and example; ``"warn"`` logs out-of-range ids and goes on (FBGEMM then clamps the id
            to row 0) but still stops on problems no clamp can fix (duplicate or missing keys, bad
            weights); ``"off"``.
        check_finite: stop every rank with the step number when the loss, a looked-up embedding or
            an embedding gradient is not finite (also on with ``Trainer(detect_anomaly=True)``).
            Costs one small all-reduce per step.
    """

    validate_inputs: ValidateInputs = "error"
    check_finite: bool = False

    def __post_init__(self) -> None:
        if self.validate_inputs not in VALIDATE_INPUTS:
            raise ValueError(
                f"GuardConfig(validate_inputs={self.validate_inputs!r}) is not one of {list(VALIDATE_INPUTS)}."
            )
        if not isinstance(self.check_finite, bool):
            raise ValueError(f"GuardConfig(check_finite={self.check_finite!r}) must be a bool.")
