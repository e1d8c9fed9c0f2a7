#!/usr/bin/env bash
# Installs lightning-recsys and its pinned stack into the current Python environment.
#
# torchrec 1.8.0 declares fbgemm-gpu (the CUDA build) and torchmetrics==1.0.3 as hard
# dependencies, which break CPU machines and clash with lightning's torchmetrics. So torchrec
# goes in with --no-deps, its real needs are listed in pyproject.toml, and the fbgemm build is
# chosen here: fbgemm-gpu where an NVIDIA driver is visible, fbgemm-gpu-cpu otherwise.
# Override the choice with FBGEMM_VARIANT=cpu|cuda.
set -euo pipefail

PYTHON=${PYTHON:-python}
TORCH_VERSION=2.13.0
TORCHREC_VERSION=1.8.0
FBGEMM_VERSION=1.8.0
EXTRAS=${1:-}

variant=${FBGEMM_VARIANT:-}
if [ -z "$variant" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    variant=cuda
  else
    variant=cpu
  fi
fi
case "$variant" in
  cpu) fbgemm="fbgemm-gpu-cpu==${FBGEMM_VERSION}" ;;
  cuda) fbgemm="fbgemm-gpu==${FBGEMM_VERSION}" ;;
  *) echo "FBGEMM_VARIANT=$variant is not one of: cpu, cuda" >&2; exit 2 ;;
esac
echo "lightning-recsys install: torch ${TORCH_VERSION}, torchrec ${TORCHREC_VERSION}, ${fbgemm} (${variant})"

pip_install() { "$PYTHON" -m pip install --disable-pip-version-check -q "$@"; }
pip_install "torch==${TORCH_VERSION}"
pip_install --no-deps "torchrec==${TORCHREC_VERSION}" "$fbgemm"
pip_install -e ".${EXTRAS:+[$EXTRAS]}"
