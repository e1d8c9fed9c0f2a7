"""Argument checks shared by the encoders: each error names the encoder, the argument, its value and the rule."""

from __future__ import annotations

import math


def check_int(owner: str, name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: {name}={value!r} must be an integer >= {minimum}.")
    return value


def check_probability(owner: str, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{owner}: {name}={value!r} must be a probability in [0, 1).")
    return float(value)


def check_positive(owner: str, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{owner}: {name}={value!r} must be a finite number > 0.")
    return float(value)
