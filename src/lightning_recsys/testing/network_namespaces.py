"""Whether this machine can host the emulated cluster's network namespaces (the tests that need them skip otherwise)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys


def namespace_skip_reason(root_for: str) -> str | None:
    """Why network namespaces can't be made here (None: they can); ``root_for`` says what root is needed for."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return f"needs root to {root_for}"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return f"iproute2 is not installed ({', '.join(missing)} not on PATH)"
    probe = f"lrsec-probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], check=False, capture_output=True, text=True, timeout=20)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True, timeout=20)
    return None
