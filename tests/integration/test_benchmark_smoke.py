"""The benchmark scripts run (tiny sizes, CPU), so they cannot rot between the runs that publish numbers."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_throughput_script_runs_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_throughput.py"), "--accelerator", "cpu", "--tiny", "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["global_steps"] == 6 and result["examples_per_sec"] > 0
