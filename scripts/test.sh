#!/usr/bin/env bash
# Set up (idempotent), then run the test suite and the docstring examples; arguments go to pytest.
# With no arguments the run is spread over REMAT_TEST_WORKERS pytest-xdist workers (default 2;
# 0 runs this process alone; on a quiet 2-core machine two workers took 17.3 min against 22.2,
# and the whole matrix passed under them): tests
# that share a costly module-scoped result are grouped onto one worker by xdist_group marks
# (--dist loadgroup), and each worker gets its share of the cores for torch's threads (conftest.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh
# With no arguments: the tests and every docstring example of the package.
[ $# -gt 0 ] || set -- tests src/remat --doctest-modules -n "${REMAT_TEST_WORKERS:-2}" --dist loadgroup
status=0
.venv/bin/python -m pytest -q "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "test.sh: error: pytest collected no tests (exit 5); check the paths and -k filters" >&2
fi
exit "$status"
