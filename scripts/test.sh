#!/usr/bin/env bash
# Set up (idempotent), then run the test suite and the docstring examples; arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh
# With no arguments: the tests and every docstring example of the package.
[ $# -gt 0 ] || set -- tests src/remat --doctest-modules
status=0
.venv/bin/python -m pytest -q "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "test.sh: error: pytest collected no tests (exit 5); check the paths and -k filters" >&2
fi
exit "$status"
