#!/usr/bin/env bash
# The GPU check (`make gpu-check OUT=<dir>`): the gpu-marked tests, a single-GPU throughput run and the
# same run with pipeline='off', the codec speeds on CUDA (FBGEMM's kernels against our torch codecs),
# with every result written under OUT. Bounded to about 10 minutes; needs no network (see docs/architecture.md, "GPU check").
set -uo pipefail
OUT=${1:?usage: scripts/gpu_check.sh OUTDIR}
PYTHON=${PYTHON:-python}
mkdir -p "$OUT"
{ nvidia-smi || echo "nvidia-smi not found"; } > "$OUT/nvidia-smi.txt" 2>&1
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'devices', torch.cuda.device_count())" \
  > "$OUT/torch.txt" 2>&1
status=0
timeout 360 "$PYTHON" -m pytest tests -m gpu -q -rs --junitxml="$OUT/gpu-tests.xml" > "$OUT/gpu-tests.txt" 2>&1 || status=1
timeout 100 "$PYTHON" benchmarks/gpu_throughput.py --out "$OUT/gpu_throughput.json" > "$OUT/gpu_throughput.txt" 2>&1 || status=1
timeout 100 "$PYTHON" benchmarks/gpu_throughput.py --pipeline off --out "$OUT/gpu_throughput_pipeline_off.json" \
  > "$OUT/gpu_throughput_pipeline_off.txt" 2>&1 || status=1
timeout 60 "$PYTHON" benchmarks/codec_speed.py --device cuda --json "$OUT/codec_speed.json" > "$OUT/codec_speed.txt" 2>&1 || status=1
tail -n 3 "$OUT/gpu-tests.txt"; tail -n 20 "$OUT/gpu_throughput.txt"; tail -n 20 "$OUT/gpu_throughput_pipeline_off.txt"; tail -n 20 "$OUT/codec_speed.txt"
exit $status
