"""Helpers that this package's tests and benchmarks share, importable from both as any module is.

- ``processes``: the multi-process harness (``run_ranks``: gloo ranks with a free port, bounded waits
  and no orphans; ``run_processes``, ``run_torchrun_nodes`` for console commands and torchrun nodes).
- ``network_namespaces``: whether this machine can host an emulated cluster's network namespaces.

Like ``torchrec.test_utils``, this ships with the package; nothing else in it imports this.
"""
