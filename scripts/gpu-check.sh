#!/usr/bin/env bash
# One command for a machine with a GPU: the CUDA test group and every --device cuda benchmark
# (offload, overhead and SAC steps, the planner, estimated vs measured device memory, the
# compiled planner against torch's memory budget), written to one markdown report whose path
# is printed last (default: remat-out/gpu-check-<time>.md). About 9 minutes on an H100.
#
#   bash scripts/gpu-check.sh [--out PATH] [--parts tests,offload,overhead,planner,memory,compiled]
#
# Runs under $PYTHON (default .venv/bin/python: give an interpreter whose torch has CUDA).
# Without a CUDA device it says so in one line and exits 0. The same pipeline runs on the CPU
# with small sizes: python benchmarks/gpu_check.py --device cpu (tests/repo/test_gpu_check.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

python="${PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=$(command -v python3); fi
fi
if ! "$python" - <<'PY' 2>/dev/null
import sys, torch
sys.exit(0 if torch.cuda.is_available() else 1)
PY
then
  echo "gpu-check: no CUDA device visible to $python (torch $("$python" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo 'not installed')); nothing to check."
  exit 0
fi
PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" exec "$python" benchmarks/gpu_check.py --device cuda "$@"
