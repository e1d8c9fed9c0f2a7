"""Upstream code's implicit ``logging.basicConfig()`` is undone; a user's own logging configuration is not."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

from lightning_recsys._upstream_logging import root_logger_left_unconfigured


def _bare_root(monkeypatch: pytest.MonkeyPatch) -> logging.Logger:
    """The root logger with no handlers, as in a fresh interpreter. Called in the test's body: pytest adds its
    capture handlers to the root logger after the fixtures ran; they come back at teardown."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    return root


def test_a_handler_added_inside_the_block_is_removed(monkeypatch):
    bare_root = _bare_root(monkeypatch)
    with root_logger_left_unconfigured():
        logging.info("an upstream library's message")  # the stdlib's module-level call runs basicConfig()
        assert bare_root.handlers, "logging.info no longer configures the root logger: this workaround can go"
    assert bare_root.handlers == []


def test_a_configured_root_logger_is_left_alone(monkeypatch):
    bare_root = _bare_root(monkeypatch)
    users = logging.StreamHandler()
    bare_root.addHandler(users)
    with root_logger_left_unconfigured():
        logging.warning("a message")
        added_later = logging.NullHandler()
        bare_root.addHandler(added_later)
    assert bare_root.handlers == [users, added_later]


def _run(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("configured", ["before importing lightning_recsys", "after importing it and TorchRec"])
def test_the_users_basic_config_works(configured):
    """Configured before: it is kept. Configured after FBGEMM's import: it takes effect (with a root handler left by
    that import, ``basicConfig`` would do nothing: no format, no INFO level)."""
    before = configured.startswith("before")
    result = _run(f"""
        import logging
        if {before}:
            logging.basicConfig(level=logging.INFO, format="USER %(name)s: %(message)s")
        import lightning_recsys.models  # imports TorchRec and FBGEMM
        import torchrec
        if not {before}:
            logging.basicConfig(level=logging.INFO, format="USER %(name)s: %(message)s")
        logging.getLogger("my_project").info("hello")
        print(len(logging.getLogger().handlers))
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("USER my_project: hello") == 1, result.stderr[-3000:]
    assert result.stdout.split() == ["1"], "the root logger should hold the user's handler only"
