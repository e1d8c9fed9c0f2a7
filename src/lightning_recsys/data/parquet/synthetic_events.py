"""Synthetic raw events for trying ``prepare`` (and the prepared-data readers) without a download.

    lightning-recsys prepare --synthetic-events 10000000 --output-raw raw/events.parquet --string-ids
    lightning-recsys prepare --input raw/events.parquet --output prepared --time-column ts

A raw event log as a data lake holds one: a parquet file of ``user_id``, ``item_id``, ``ts``
(Unix seconds) rows, users interleaved inside each chunk. Item popularity is Zipf (exponent
``zipf_exponent`` over ``num_items``); a user's history length is lognormal with mean
``mean_length`` (9 is Amazon Beauty-like; 200 gives long histories), at least 1 and at most
``max_length``; times advance by exponential gaps from a per-user start (whole seconds, so some
events tie). Ids are integers, or strings (``U…``/``I…``) with ``string_ids``. Generation is
vectorized numpy and writes one row group per ``chunk_events`` events, so memory stays bounded
whatever ``num_events`` is.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

USER_COLUMN, ITEM_COLUMN, TIME_COLUMN = "user_id", "item_id", "ts"
_ID_MULTIPLIER = 0x9E3779B1  # odd: i -> i * m mod 2**40 is a bijection, so ids look scattered
_ID_MASK = (1 << 40) - 1
_START_TIME = 1_500_000_000  # 2017-07-14, seconds


@dataclasses.dataclass(frozen=True)
class SyntheticEventsConfig:
    """The generator's settings; each is checked at construction (errors name the field, value and rule)."""

    num_events: int
    num_items: int = 1_000_000
    mean_length: float = 9.0
    length_sigma: float = 1.0
    max_length: int = 5_000
    zipf_exponent: float = 1.1
    string_ids: bool = False
    seed: int = 0
    chunk_events: int = 1_000_000
    mean_gap_seconds: float = 86_400.0

    def __post_init__(self) -> None:
        checks = (
            ("num_events", self.num_events >= 1, "must be >= 1"),
            ("num_items", self.num_items >= 1, "must be >= 1"),
            ("mean_length", self.mean_length >= 1.0, "must be >= 1"),
            ("length_sigma", self.length_sigma > 0.0, "must be > 0"),
            ("max_length", self.max_length >= 1, "must be >= 1"),
            ("zipf_exponent", self.zipf_exponent > 0.0, "must be > 0"),
            ("chunk_events", self.chunk_events >= 1, "must be >= 1"),
            ("mean_gap_seconds", self.mean_gap_seconds >= 0.0, "must be >= 0"),
        )
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} {rule}.")


def _zipf_cdf(num_items: int, exponent: float) -> np.ndarray:
    weights = np.arange(1, num_items + 1, dtype=np.float64) ** -exponent
    cdf = np.cumsum(weights)
    return cdf / cdf[-1]


def _scatter(index: np.ndarray) -> np.ndarray:
    """A bijection of [0, 2**40) so ids are not their popularity rank or creation order."""
    return (index.astype(np.uint64) * np.uint64(_ID_MULTIPLIER)) & np.uint64(_ID_MASK)


def _ids(index: np.ndarray, prefix: str, as_strings: bool) -> pa.Array:
    scattered = pa.array(_scatter(index).astype(np.int64))
    if not as_strings:
        return scattered
    return pc.binary_join_element_wise(prefix, pc.cast(scattered, pa.string()), "")


def _lengths(rng: np.random.Generator, config: SyntheticEventsConfig, count: int) -> np.ndarray:
    sigma = config.length_sigma
    mu = math.log(config.mean_length) - sigma * sigma / 2.0  # lognormal mean = exp(mu + sigma^2 / 2)
    return np.clip(np.rint(rng.lognormal(mu, sigma, size=count)), 1, config.max_length).astype(np.int64)


def generate_events(path: str | Path, config: SyntheticEventsConfig) -> dict[str, int]:
    """Write ``config.num_events`` raw events to the parquet file ``path``; returns ``{"events", "users"}``."""
    rng = np.random.default_rng(config.seed)
    cdf = _zipf_cdf(config.num_items, config.zipf_exponent)
    schema = pa.schema(
        [
            (USER_COLUMN, pa.string() if config.string_ids else pa.int64()),
            (ITEM_COLUMN, pa.string() if config.string_ids else pa.int64()),
            (TIME_COLUMN, pa.int64()),
        ]
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    written, next_user = 0, 0
    with pq.ParquetWriter(str(path), schema, compression="zstd") as writer:
        while written < config.num_events:
            want = min(config.chunk_events, config.num_events - written)
            # Enough users for this chunk: the last one is cut so the total is exact.
            lengths = _lengths(rng, config, max(1, int(want / config.mean_length * 1.2) + 8))
            ends = np.cumsum(lengths)
            keep = int(np.searchsorted(ends, want, side="left")) + 1
            lengths = lengths[:keep]
            lengths[-1] -= int(ends[keep - 1]) - want
            users = np.repeat(np.arange(next_user, next_user + keep), lengths)
            next_user += keep
            items = np.searchsorted(cdf, rng.random(want), side="right").clip(0, config.num_items - 1)
            # Time: a per-user start plus the cumulative gaps of its events (whole seconds: some tie).
            gaps = np.floor(rng.exponential(config.mean_gap_seconds, size=want)).astype(np.int64)
            running = np.cumsum(gaps)
            first = np.concatenate(([0], np.cumsum(lengths)[:-1]))
            before_user = np.repeat(running[first] - gaps[first], lengths)
            starts = np.repeat(_START_TIME + rng.integers(0, 3 * 365 * 86_400, size=keep), lengths)
            times = starts + running - before_user
            # A log interleaves its users: shuffle the chunk's rows (each user's times stay as they are).
            order = rng.permutation(want)
            table = pa.Table.from_arrays(
                [_ids(users[order], "U", config.string_ids), _ids(items[order], "I", config.string_ids), pa.array(times[order])],
                schema=schema,
            )
            writer.write_table(table, row_group_size=want)
            written += want
    return {"events": written, "users": next_user}
