"""A tiny MovieLens-100k-format directory for the CLI tests: 20 users, 30 movies, 400 ratings."""

from __future__ import annotations

from pathlib import Path

OCCUPATIONS = ["technician", "writer", "student", "other"]


def write_tiny_movielens(directory: Path, *, spread_items: bool = False, ratings_per_second: int = 1) -> None:
    """``u.user``, ``u.item`` and ``u.data`` in the real format; rating ``r`` is by user ``1 + r % 20``.

    ``spread_items`` shifts the movie of rating ``r`` by ``r // 20`` (a user then rates different
    movies, as histories want); ``ratings_per_second`` ratings share each timestamp (ties).
    """
    genres = lambda i: "|".join("1" if g == i % 19 else "0" for g in range(19))  # noqa: E731
    users = "".join(f"{u}|{18 + u}|{'MF'[u % 2]}|{OCCUPATIONS[u % 4]}|{10000 + u}\n" for u in range(1, 21))
    (directory / "u.user").write_text(users)
    items = "".join(f"{i}|Movie {i} (1995)|01-Jan-1995||http://x/{i}|{genres(i)}\n" for i in range(1, 31))
    (directory / "u.item").write_text(items, encoding="latin-1")
    shift = (lambda r: r // 20) if spread_items else (lambda r: 0)  # noqa: E731
    ratings = (f"{1 + r % 20}\t{1 + (r * 7 + shift(r)) % 30}\t{1 + r % 5}\t{880000000 + r // ratings_per_second}\n" for r in range(400))
    (directory / "u.data").write_text("".join(ratings))
