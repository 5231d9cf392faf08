#!/usr/bin/env bash
# Build the documentation site into site/ (strict: a broken link or docstring fails).
#   bash scripts/docs.sh            # build
#   bash scripts/docs.sh serve      # preview at http://127.0.0.1:8000
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh >/dev/null
if ! .venv/bin/python -c 'import mkdocs, material, mkdocstrings_handlers.python' 2>/dev/null; then
  echo "docs.sh: installing the docs extra (mkdocs, mkdocstrings)"
  .venv/bin/python -m pip install --quiet -e '.[docs]' 2>&1 | grep -v '^WARNING: Location' || true
fi
if [ "${1:-}" = "serve" ]; then
  NO_MKDOCS_2_WARNING=1 exec .venv/bin/mkdocs serve
fi
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet
echo "docs.sh: site built in site/ ($(find site -name '*.html' | wc -l) pages)"
