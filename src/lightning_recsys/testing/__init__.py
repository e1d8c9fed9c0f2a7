"""Helpers that this package's tests and benchmarks share, importable from both as any module is.

- ``processes``: the multi-process harness (``run_ranks``: gloo ranks with a free port, bounded waits
  and no orphans; ``run_processes``, ``run_torchrun_nodes`` for console commands and torchrun nodes).
- ``network_namespaces``: whether this machine can host an emulated cluster's network namespaces.
- ``oracle``: the correctness oracle, one API for three workloads (``oracle.click``, ``oracle.sequence``,
  ``oracle.pretrain``): a tiny model trained unsharded in one process, and the same model fitted sharded.
- ``crafted_checkpoints``: small committed checkpoints written in one process, and the damaged and
  hostile ones the checkpoint security tests and ``benchmarks/checkpoint_fuzz.py`` load.

Like ``torchrec.test_utils``, this ships with the package; nothing else in it imports this, and this imports
nothing from the repository's tests/ or benchmarks/ (``tests/unit/test_layering.py``). Importing this package
imports none of its modules.
"""
