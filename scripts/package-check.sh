#!/usr/bin/env bash
# Build the wheel and the sdist, install each into a fresh virtual environment and import it.
# Catches what an editable install hides: files missing from the package, a wrong version.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh >/dev/null
.venv/bin/python -c 'import build' 2>/dev/null || .venv/bin/python -m pip install --quiet build
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
.venv/bin/python -m build --outdir "$work/dist" . >/dev/null
torch_version=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("torch"))')
version=$(.venv/bin/python -c 'import remat; print(remat.__version__)')
for artifact in "$work"/dist/remat-*.whl "$work"/dist/remat-*.tar.gz; do
  env="$work/env-$(basename "$artifact" | tr -c 'a-zA-Z0-9\n' '_')"
  python3 -m venv "$env"
  "$env/bin/python" -m pip install --quiet "torch==${torch_version%%+*}" 2>&1 | grep -v '^WARNING: Location' || true
  "$env/bin/python" -m pip install --quiet "$artifact" 2>&1 | grep -v '^WARNING: Location' || true
  (cd "$work" && "$env/bin/python" - "$version" <<'PY'
import importlib.metadata
import sys

import torch

import remat

assert remat.__version__ == sys.argv[1] == importlib.metadata.version("remat"), remat.__version__
x = torch.randn(4, 4, requires_grad=True)
remat.checkpoint(torch.sin, x).sum().backward()
assert remat.nn.checkpoint_wrapper and remat.plan and remat.apply_config
PY
  )
  echo "package-check: $(basename "$artifact") installs and imports (remat $version)"
done
