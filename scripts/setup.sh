#!/usr/bin/env bash
# Idempotent setup: .venv with the CPU torch build, then remat (editable) + test and lint tools.
# Re-running is cheap: the editable install is skipped while pyproject.toml is unchanged.
# PYTHON=python3.12 bash scripts/setup.sh picks another interpreter (3.10 or newer).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TORCH_SPEC="torch==2.13.0"
VENV_PY=.venv/bin/python
STAMP=.venv/.remat-setup-stamp

if [ ! -x "$VENV_PY" ]; then
  python="${PYTHON:-}"
  if [ -z "$python" ]; then
    python=$(command -v python3.11 || command -v python3 || true)
  fi
  if [ -z "$python" ] || ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "setup.sh: error: need Python 3.10 or newer (3.11 recommended); set PYTHON=/path/to/python" >&2
    exit 1
  fi
  echo "setup.sh: creating .venv with $("$python" --version)"
  "$python" -m venv .venv
  "$VENV_PY" -m pip install --quiet --upgrade pip
fi

# torch first, on its own: remat's dependency line alone could resolve to a different build.
if ! "$VENV_PY" -c 'import torch' 2>/dev/null; then
  echo "setup.sh: installing $TORCH_SPEC"
  if ! "$VENV_PY" -m pip install "$TORCH_SPEC"; then
    echo "setup.sh: error: could not install $TORCH_SPEC (CPU build expected)." >&2
    echo "  Install a CPU build of torch>=2.4 into .venv yourself, then re-run this script." >&2
    exit 1
  fi
fi

# The version lives in __init__.py (pyproject reads it): a bump means a reinstall too.
fingerprint="$(cksum pyproject.toml) $(grep -m1 "^__version__" src/remat/__init__.py)"
installed='import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, ["remat", "pytest", "importlinter"])))'
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$fingerprint" ] || ! "$VENV_PY" -c "$installed"; then
  echo "setup.sh: installing remat (editable) with the test and lint extras"
  "$VENV_PY" -m pip install --quiet -e '.[test,lint]'
  echo "$fingerprint" > "$STAMP"
fi
echo "setup.sh: ready (torch $("$VENV_PY" -c 'import importlib.metadata as m; print(m.version("torch"))'))"
