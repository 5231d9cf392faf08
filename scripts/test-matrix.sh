#!/usr/bin/env bash
# Run the test suite on several torch releases, each in its own cached virtual environment.
#
#   bash scripts/test-matrix.sh                 # the whole matrix (see MATRIX below)
#   bash scripts/test-matrix.sh 2.11.0 -- -x    # one release; arguments after -- go to pytest
#   bash scripts/test-matrix.sh --prepare       # only create the environments
#
# Environments live in $REMAT_TORCH_ENVS (default ~/.cache/remat/torch-envs), one per release,
# and are reused while the test requirements in pyproject.toml are unchanged. A release other
# than the local CPU build downloads a CUDA build of several GB the first time (a few minutes).
# The matrix: the declared minimum (latest patch of its minor), 2.7 (below the 2.9 limit of
# compiled policy objects), a middle release and the newest release on the package index.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

MATRIX=(2.4.1 2.7.1 2.11.0 2.15.0)
ENVS="${REMAT_TORCH_ENVS:-$HOME/.cache/remat/torch-envs}"
python="${PYTHON:-$(command -v python3.11 || command -v python3)}"

prepare_only=0
if [ "${1:-}" = "--prepare" ]; then prepare_only=1; shift; fi
versions=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do versions+=("$1"); shift; done
[ $# -gt 0 ] && shift
[ ${#versions[@]} -gt 0 ] || versions=("${MATRIX[@]}")

test_requirements() {
  "$python" - <<'PY'
import tomllib
with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["optional-dependencies"]["test"]))
PY
}

# Create (or reuse) the environment for one torch release; prints its path.
quiet_pip() {
  # pip warns about every configured local index that lacks a package; keep real errors only.
  "$@" 2>&1 | grep -v '^WARNING: Location' >&2 || true
  return "${PIPESTATUS[0]}"
}

ensure_env() {
  local version=$1 env="$ENVS/torch-$1"
  local recipe="recipe-2 torch==$version"
  local wanted; wanted="$recipe $(test_requirements | cksum)"
  local stamp; stamp=$(cat "$env/.remat-matrix-stamp" 2>/dev/null || true)
  if [ -x "$env/bin/python" ] && [ "$stamp" = "$wanted" ]; then
    echo "$env"; return
  fi
  local pins="$env/torch-pin.txt"
  # Same torch, other test requirements: install those into the environment (no new torch).
  if [ -x "$env/bin/python" ] && [ "${stamp% * *}" = "$recipe" ] && [ -f "$pins" ]; then
    echo "test-matrix: updating the test requirements of $env" >&2
  else
    echo "test-matrix: preparing $env (first time: downloads torch $version)" >&2
    rm -rf "$env"; mkdir -p "$ENVS"
    "$python" -m venv "$env"
    echo "torch==$version" > "$pins"
    # transformers 5 needs torch >= 2.6; older torch gets the last 4.x line.
    case "$version" in 2.[0-5].*) echo "transformers<5" >> "$pins" ;; esac
  fi
  # The machine-wide pip constraint (if any) caps torch below the newest release; the matrix
  # pins its own torch, so it uses only its own pin file.
  export PIP_CONSTRAINT="$pins"
  quiet_pip "$env/bin/python" -m pip install --quiet --upgrade pip
  quiet_pip "$env/bin/python" -m pip install --quiet "torch==$version"
  # shellcheck disable=SC2046
  quiet_pip "$env/bin/python" -m pip install --quiet $(test_requirements)
  unset PIP_CONSTRAINT
  echo "$wanted" > "$env/.remat-matrix-stamp"
  echo "$env"
}

if [ "$prepare_only" -eq 1 ]; then
  for version in "${versions[@]}"; do ensure_env "$version"; done
  exit 0
fi

# With no pytest arguments: the tests whose outcome can depend on the torch release. The slow
# tests, the benchmark scripts, the docs pages and the GPU-check report run once, on the main
# release (scripts/test.sh), which keeps the whole CI run well under its 40-minute budget.
# Spread over REMAT_TEST_WORKERS pytest-xdist workers (default 2; 0 runs one process; see scripts/test.sh).
if [ $# -eq 0 ]; then
  # The distributed model matrix: every form under FSDP2, one form per front-end kind under
  # each other engine (tests/integration/test_distributed_models.py, _forms).
  export REMAT_DISTRIBUTED_ROWS=per-release
  # The pipeline matrix: one form per kind under every schedule this torch has
  # (tests/integration/test_pipelining.py, _cells).
  export REMAT_PIPELINE_CELLS=per-release
  # Tests of code that imports no torch (the solvers, the cost model) cannot change with the
  # release: they run once, on the main release.
  set -- -m "not slow and not torch_free" --ignore=tests/repo/test_benchmark_overhead.py \
    --ignore=tests/repo/test_benchmark_planner.py --ignore=tests/repo/test_docs.py \
    --ignore=tests/repo/test_gpu_check.py -n "${REMAT_TEST_WORKERS:-2}" --dist loadgroup
fi
failed=()
summary=()
for version in "${versions[@]}"; do
  start=$SECONDS
  env=$(ensure_env "$version")
  # remat itself from this checkout, without touching the environment's dependencies.
  PIP_CONSTRAINT="$env/torch-pin.txt" quiet_pip "$env/bin/python" -m pip install --quiet --no-deps -e .
  echo "test-matrix: torch $("$env/bin/python" -c 'import torch; print(torch.__version__)')"
  log=$(mktemp)
  status=0
  "$env/bin/python" -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$log" || status=${PIPESTATUS[0]}
  line=$(grep -E '^=*.*(passed|failed|error).* in [0-9.]+s' "$log" | tail -n 1 | tr -d '=')
  rm -f "$log"
  summary+=("torch $version: ${line:-no summary} (exit $status, $((SECONDS - start)) s with setup)")
  [ "$status" -eq 0 ] || failed+=("$version")
done

echo "test-matrix: summary"
printf '  %s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "test-matrix: error: the suite failed on torch ${failed[*]}" >&2
  exit 1
fi
