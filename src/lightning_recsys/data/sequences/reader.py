"""Sequence files in the BERT4Rec/SASRec format: one ``user item`` pair per line, each user's lines in time order.

This is the layout of ``data/beauty.txt`` in ``FeiSun/BERT4Rec`` and of the files SASRec's
``util.data_partition`` reads: whitespace-separated integer ids from 1, a user's lines contiguous and
oldest first. With ``num_action_types > 0`` each line has a third field, the action type
``0 .. num_action_types - 1`` of that interaction.

Reading is vectorized with numpy (Amazon Beauty's 353,962 lines take 0.1 to 0.4 s on a busy 2-core machine):
cheap whole-file checks (allowed bytes, fields per line, digits per id) decide whether the file is
clean; if one fails, an exact line-by-line pass finds the first bad line and raises
``MalformedLineError`` naming the file, the 1-based line number, the line and what is wrong.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lightning_recsys.data.readers import MalformedLineError, iter_lines

_GZIP_MAGIC = b"\x1f\x8b"
_MAX_DIGITS = 18  # every id of up to 18 digits fits int64
_MAX_LINE_IN_MESSAGE = 120
_WHITESPACE = (ord(" "), ord("\t"), ord("\r"))
_FIELD_NAMES = ("user", "item", "action")


@dataclass(frozen=True)
class UserSequences:
    """Every user's interactions, oldest first, concatenated user after user.

    ``items[offsets[u]:offsets[u + 1]]`` are user ``u``'s item rows (file id - 1, the rows of the item
    table), ``actions`` (or ``None``) their action types and ``timestamps`` (or ``None``) their times,
    int64 seconds; ``user_ids[u]`` is the user's id in the source. ``num_items`` is the item table's
    rows, ``num_action_types`` 0 when there are no actions.
    """

    items: np.ndarray
    offsets: np.ndarray
    user_ids: np.ndarray
    num_items: int
    num_action_types: int = 0
    actions: np.ndarray | None = None
    timestamps: np.ndarray | None = None

    def __post_init__(self) -> None:
        if len(self.offsets) < 1 or self.offsets[0] != 0 or self.offsets[-1] != len(self.items):
            raise ValueError(f"offsets must run from 0 to len(items)={len(self.items)}; got {self.offsets[:1]}..{self.offsets[-1:]}.")
        if (self.actions is None) != (self.num_action_types == 0):
            raise ValueError(f"actions must be given exactly when num_action_types={self.num_action_types} > 0.")
        if self.timestamps is not None and len(self.timestamps) != len(self.items):
            raise ValueError(f"timestamps must be aligned with items: {len(self.timestamps)} timestamps for {len(self.items)} items.")
        if len(self.items) and (self.items.min() < 0 or self.items.max() >= self.num_items):
            raise ValueError(f"item rows must be in [0, num_items={self.num_items}); got {self.items.min()}..{self.items.max()}.")

    @property
    def num_users(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def group_by_user(users: np.ndarray, items: np.ndarray, actions: np.ndarray | None, num_items: int, num_action_types: int) -> UserSequences:
    """``UserSequences`` from per-interaction arrays in which each user's interactions are contiguous, oldest first."""
    starts = np.flatnonzero(np.concatenate([[True], users[1:] != users[:-1]])) if len(users) else np.zeros(0, np.int64)
    offsets = np.append(starts, len(users)).astype(np.int64)
    return UserSequences(
        items=items.astype(np.int64), offsets=offsets, user_ids=users[starts].astype(np.int64), num_items=num_items,
        num_action_types=num_action_types, actions=None if actions is None else actions.astype(np.int64),
    )


def read_sequence_file(path: str | Path, *, num_items: int | None = None, num_action_types: int = 0) -> UserSequences:
    """Read a ``user item`` (or ``user item action``) file; see the module docstring.

    Args:
        path: the file, plain text or gzip (detected by its first bytes).
        num_items: the item table's rows; every item id must be ``<= num_items``. ``None``: the
            largest item id in the file.
        num_action_types: 0 for two fields per line; otherwise three, the third an action type in
            ``0 .. num_action_types - 1``.

    Raises:
        MalformedLineError: a line with the wrong number of fields, a field that is not a whole
            number, an id below 1, an item id above ``num_items``, an action out of range, or a user
            whose lines are not contiguous (the line where the user comes back is named).
        ValueError: the file has no lines.
    """
    path = str(path)
    raw = Path(path).read_bytes()
    if raw[:2] == _GZIP_MAGIC:
        raw = gzip.decompress(raw)
    num_fields = 3 if num_action_types else 2
    values = _parse_clean(raw, num_fields)
    if values is None or not _values_ok(values, num_items, num_action_types):
        values = _parse_exactly(path, num_fields, num_items, num_action_types)  # raises at the first bad line
    if not len(values):
        raise ValueError(f"{path} has no lines: a sequence file has one 'user item' pair per line.")
    users, items = values[:, 0], values[:, 1] - 1
    actions = values[:, 2] if num_action_types else None
    rows = int(values[:, 1].max()) if num_items is None else num_items
    return group_by_user(users, items, actions, rows, num_action_types)


def _parse_clean(raw: bytes, num_fields: int) -> np.ndarray | None:
    """``[lines, num_fields]`` int64 if every line is ``num_fields`` runs of at most 18 digits; else ``None``."""
    buf = np.frombuffer(raw, dtype=np.uint8)
    digit = (buf >= ord("0")) & (buf <= ord("9"))
    newline = buf == ord("\n")
    space = np.isin(buf, _WHITESPACE)
    if not np.all(digit | newline | space):
        return None
    line_ends = np.flatnonzero(newline)
    num_lines = len(line_ends) + (len(raw) > 0 and raw[-1:] != b"\n")
    run_start = np.flatnonzero(digit & ~np.concatenate([[False], digit[:-1]]))
    run_end = np.flatnonzero(digit & ~np.concatenate([digit[1:], [False]])) + 1
    if len(run_start) and (run_end - run_start).max() > _MAX_DIGITS:
        return None
    per_line = np.bincount(np.searchsorted(line_ends, run_start), minlength=num_lines)
    if np.any(per_line != num_fields):
        return None
    values = np.fromstring(raw, dtype=np.int64, sep=" ")  # whitespace-separated text; checked clean above
    return values.reshape(num_lines, num_fields)


def _values_ok(values: np.ndarray, num_items: int | None, num_action_types: int) -> bool:
    """Whether the parsed values pass every rule that is not about syntax (ids, actions, contiguous users)."""
    if not len(values):
        return True
    if values[:, :2].min() < 1 or (num_items is not None and values[:, 1].max() > num_items):
        return False
    if num_action_types and values[:, 2].max() >= num_action_types:
        return False
    users = values[:, 0]
    run_users = users[np.concatenate([[True], users[1:] != users[:-1]])]
    return len(np.unique(run_users)) == len(run_users)


def _parse_exactly(path: str, num_fields: int, num_items: int | None, num_action_types: int) -> np.ndarray:
    """The line-by-line rules: the parsed values, or ``MalformedLineError`` at the first bad line."""
    rows: list[list[int]] = []
    last_line_of_user: dict[int, int] = {}
    previous_user: int | None = None
    expected = " ".join(_FIELD_NAMES[:num_fields])
    for number, line in iter_lines(path):
        fields = line.split()
        problem = None
        if len(fields) != num_fields:
            problem = f"expected {num_fields} whitespace-separated fields ({expected}), found {len(fields)}"
        else:
            problem = _field_problem(fields, num_items, num_action_types)
        if problem is None:
            user = int(fields[0])
            if user != previous_user and user in last_line_of_user:
                problem = (
                    f"user {user}'s lines are not contiguous: its earlier lines end at line {last_line_of_user[user]}, "
                    "and each user's lines must be together, oldest first (sort the file by user, keeping time order)"
                )
        if problem is not None:
            shown = line if len(line) <= _MAX_LINE_IN_MESSAGE else line[:_MAX_LINE_IN_MESSAGE] + "..."
            raise MalformedLineError(
                f"{path}, line {number}: {problem}. The line is {shown!r}. Fix or remove the line.",
                path=path, line_number=number, line=line, problem=problem,
            )
        last_line_of_user[user] = number
        previous_user = user
        rows.append([int(field) for field in fields])
    return np.array(rows, dtype=np.int64).reshape(-1, num_fields)


def _field_problem(fields: list[str], num_items: int | None, num_action_types: int) -> str | None:
    for name, field in zip(_FIELD_NAMES, fields):
        if not (field.isascii() and field.isdigit()):  # int() would also take "+5", "5_0" and "٥"
            return f"the {name} {'type' if name == 'action' else 'id'} {field!r} is not a whole number"
        if len(field) > _MAX_DIGITS:
            return f"the {name} id {field!r} has more than {_MAX_DIGITS} digits"
    user, item = int(fields[0]), int(fields[1])
    if user < 1:
        return f"user id {user} is below 1 (ids start at 1)"
    if item < 1:
        return f"item id {item} is below 1 (ids start at 1; item id i is row i - 1 of the item table)"
    if num_items is not None and item > num_items:
        return f"item id {item} is above num_items={num_items} (the item table's rows); raise num_items or leave it unset"
    if num_action_types and int(fields[2]) >= num_action_types:
        return f"action type {fields[2]} is not in 0..{num_action_types - 1} (num_action_types={num_action_types})"
    return None
