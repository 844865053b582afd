#!/usr/bin/env bash
# Creates .venv with the pinned stack. Idempotent: `make` only calls it when
# requirements*.txt, constraints.txt or pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip --disable-pip-version-check"
echo "==> installing torch 2.13.0 (CPU build) and fbgemm-gpu-cpu 1.8.0"
# torch==2.13.0 exactly: a looser spec downloads a multi-GB CUDA build (docs/stack.md).
$PIP install -q torch==2.13.0 fbgemm-gpu-cpu==1.8.0 -c constraints.txt
echo "==> installing torchrec 1.8.0 without its declared deps (they name the CUDA fbgemm-gpu)"
$PIP install -q --no-deps torchrec==1.8.0
echo "==> installing the pinned requirements"
# pip then warns "torchrec 1.8.0 requires fbgemm-gpu, which is not installed": expected,
# fbgemm-gpu-cpu provides the same modules for the CPU build of torch.
$PIP install -q -r requirements-dev.txt -c constraints.txt 2>&1 \
  | { grep -v -E "dependency resolver does not|requires fbgemm-gpu, which is not installed" || true; }
echo "==> installing this project (editable) so TorchServe workers can import serve/"
$PIP install -q --no-deps --no-build-isolation -e .
"$VENV/bin/python" - <<'PY'
import torch, torchrec, fbgemm_gpu  # noqa: F401  (fail here, not in a test, if the stack is broken)
print(f"==> venv ready: torch {torch.__version__}, torchrec {torchrec.__version__}")
PY
