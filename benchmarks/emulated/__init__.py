"""The parts of ``benchmarks/emulated_cluster.py``: configs (what runs), network (namespaces and shaping), runs, report."""
