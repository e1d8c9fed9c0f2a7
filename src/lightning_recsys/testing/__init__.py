"""Helpers that this package's tests and benchmarks share, importable from both as any module is.

- ``processes``: the multi-process harness (``run_ranks``: gloo ranks with a free port, bounded waits
  and no orphans; ``run_processes``, ``run_torchrun_nodes`` for console commands and torchrun nodes).
- ``commands``: a command as a user types it (``lightning-recsys ...``, ``python script.py``, ``python -m``), run
  in 1 or more ranks forked from the same preloaded fork server (``run_command``, ``run_cli``): its own code,
  exit code and output, without a fresh interpreter's 10 s of imports.
- ``network_namespaces``: whether this machine can host an emulated cluster's network namespaces.
- ``oracle``: the correctness oracle, one API for three workloads (``oracle.click``, ``oracle.sequence``,
  ``oracle.pretrain``): a tiny model trained unsharded in one process, and the same model fitted sharded.
- ``crafted_checkpoints``: small committed checkpoints written in one process, and the damaged and
  hostile ones the checkpoint security tests and ``benchmarks/checkpoint_fuzz.py`` load.

Like ``torchrec.test_utils``, this ships with the package; nothing else in it imports this, and this imports
nothing from the repository's tests/ or benchmarks/ (``tests/unit/test_layering.py``). Importing this package
imports none of its modules.
"""
