"""One command for a machine with a GPU: the CUDA tests and every ``--device cuda`` benchmark, one report.

Parts, each a subprocess with a time limit (a part that fails or runs out of
time is reported as such; the others still run), all within one deadline:

* ``tests``: the CUDA test group (``pytest -m cuda``);
* ``offload``: ``benchmarks/offload.py``: the fraction of copy time hidden
  behind compute (target: at least 0.8 for remat's forms);
* ``overhead``: ``benchmarks/overhead.py``: per-region and per-op rows, and
  the GPT steps under full and save-matmuls checkpointing (target: SAC's step
  no slower than full checkpointing's, at each size);
* ``planner``: ``benchmarks/planner.py --quick``;
* ``memory``: ``benchmarks/memory_check.py``: estimated against measured
  device peak of the embedded GPT and a HF Llama (targets: 2% allocated, 10%
  reserved);
* ``compiled``: ``benchmarks/compiled_planner.py --quick``: remat's compiled
  plans against torch's ``activation_memory_budget`` at the same bytes, with
  ``max_memory_allocated`` beside the allocator meter (the table of
  ``docs/design/compile.md`` on CUDA; its targets are read from the table).

Writes one markdown report (``remat-out/gpu-check-<time>.md`` unless
``--out``) and prints its path last. ``--device cpu`` runs the same pipeline
on the CPU with small sizes (the checks that need a GPU read n/a): how the
pipeline is tested without one (``tests/repo/test_gpu_check.py``).

    python benchmarks/gpu_check.py [--device cuda|cpu] [--out PATH] [--parts tests,offload,...,compiled]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"

PARTS = ("tests", "offload", "overhead", "planner", "memory", "compiled")
DEADLINE_S = {"cuda": 540.0, "cpu": 1200.0}
"""The whole check stays under 10 minutes on an H100 (one device call): the
parts share 9. The CPU dry run has no such target (a shared CPU is slow)."""

LIMITS_S = {"tests": 120.0, "offload": 110.0, "overhead": 120.0, "planner": 100.0, "memory": 80.0,
            "compiled": 150.0}
CPU_LIMIT_FACTOR = 3.0

HIDDEN_TARGET = 0.8
HIDDEN_FORMS = ("remat offload", "remat offload_wrapper", "remat offload+ckpt", "remat policy offload")


@dataclass(frozen=True)
class Check:
    what: str
    target: str
    measured: str
    passed: bool | None  # None: not measurable here


@dataclass
class Part:
    name: str
    command: list[str]
    json_path: Path | None = None
    returncode: int | None = None
    timed_out: bool = False
    elapsed_s: float = 0.0
    output: str = ""
    data: Any = None
    checks: list[Check] = field(default_factory=list)
    not_here: str = ""  # why this part cannot run under this torch (then it is not started)

    @property
    def status(self) -> str:
        if self.not_here:
            return f"not run: {self.not_here}"
        if self.timed_out:
            return f"timed out after {self.elapsed_s:.0f} s"
        if self.returncode is None:
            return "not run (no time left)"
        return "ok" if self.returncode == 0 else f"failed (exit {self.returncode})"


def commands(device: str, folder: Path) -> list[Part]:
    """The parts and their command lines (CPU: the small sizes of a dry run)."""
    import torch

    from remat._compat.partitioner import region_memory_budgets_available

    python = sys.executable
    cpu = device == "cpu"
    tests = [python, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "-rfE"]
    # On the CPU every CUDA test skips: collect one file instead of the suite.
    tests += [str(ROOT / "tests" / "storage" / "test_offload_cuda.py")] if cpu else [str(ROOT / "tests")]
    overhead = [python, str(BENCHMARKS / "overhead.py"), "--device", device, "--json", str(folder / "overhead.json")]
    overhead += ["--quick", "--rounds", "1", "--only", "tiny,tanh,gpt-steps"] if cpu else ["--rounds", "6"]
    offload = [python, str(BENCHMARKS / "offload.py"), "--device", device, "--json", str(folder / "offload.json")]
    offload += ["--rounds", "1", "--warmup", "0"] if cpu else ["--rounds", "4", "--warmup", "1"]
    memory = [python, str(BENCHMARKS / "memory_check.py"), "--device", device, "--json", str(folder / "memory.json")]
    memory += ["--quick"] if cpu else []
    planner = [python, str(BENCHMARKS / "planner.py"), "--device", device, "--quick"]
    compiled = [python, str(BENCHMARKS / "compiled_planner.py"), "--device", device, "--quick"]
    compiled_not_here = "" if region_memory_budgets_available() else (
        f"torch {torch.__version__} has no per-region compile budgets (2.13 or newer)"
    )
    return [
        Part("tests", tests),
        Part("offload", offload, folder / "offload.json"),
        Part("overhead", overhead, folder / "overhead.json"),
        Part("planner", planner),
        Part("memory", memory, folder / "memory.json"),
        Part("compiled", compiled, not_here=compiled_not_here),
    ]


def run_part(part: Part, limit_s: float) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    start = time.perf_counter()
    try:
        done = subprocess.run(part.command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit_s)
        part.returncode = done.returncode
        part.output = done.stdout + (f"\n[stderr]\n{done.stderr}" if done.returncode and done.stderr else "")
    except subprocess.TimeoutExpired as expired:
        part.timed_out = True
        stdout = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        part.output = stdout
    part.elapsed_s = time.perf_counter() - start
    if part.json_path is not None and part.json_path.exists():
        part.data = json.loads(part.json_path.read_text())


# checks ---------------------------------------------------------------------------


def test_checks(part: Part) -> list[Check]:
    words = ("passed", "failed", "skipped", "error")
    lines = part.output.splitlines()
    summary = next((line for line in reversed(lines) if " in " in line and any(w in line for w in words)), "")
    summary = summary.strip("= ") or part.status
    passed = None if part.returncode is None or part.timed_out else part.returncode == 0
    return [Check("CUDA test group (pytest -m cuda)", "no failures", summary, passed)]


def offload_checks(part: Part) -> list[Check]:
    rows = {row["form"]: row for row in (part.data or {}).get("rows", [])}
    checks = []
    for form in HIDDEN_FORMS:
        hidden = rows.get(form, {}).get("hidden_fraction")
        measured = "n/a (no overlap on a CPU)" if hidden is None else f"{hidden:.2f}"
        checks.append(Check(f"{form}: copy time hidden", f">= {HIDDEN_TARGET}", measured,
                            None if hidden is None else hidden >= HIDDEN_TARGET))
    return checks


def overhead_checks(part: Part) -> list[Check]:
    rows = (part.data or {}).get("rows", [])
    checks = []
    for row in rows:
        what = row["what"]
        if what.startswith("per-region overhead, 1-parameter blocks"):
            ratio = row["ratio"]
            checks.append(Check(f"{what} (remat / torch)", "<= 0.5", _number(ratio),
                                None if _missing(ratio) else ratio <= 0.5))
    steps: dict[str, dict[str, float]] = {}
    for row in rows:
        for kind, prefix in (("full", "full checkpoint step, "), ("sac", "SAC save-matmuls step, ")):
            if row["what"].startswith(prefix):
                steps.setdefault(row["what"][len(prefix):], {})[kind] = row["remat"]
    for shape, pair in steps.items():
        if "full" in pair and "sac" in pair:
            checks.append(Check(f"SAC step vs full checkpoint step, {shape} (x none)", "SAC <= full",
                                f"{pair['sac']:.2f} vs {pair['full']:.2f}", pair["sac"] <= pair["full"]))
    return checks


def memory_checks(part: Part) -> list[Check]:
    checks = []
    for row in (part.data or {}).get("rows", []):
        reserved = row["reserved_error"]
        measured = f"allocated {100 * row['allocated_error']:+.2f}%"
        measured += "" if reserved is None else f", reserved {100 * reserved:+.2f}%"
        checks.append(Check(f"estimated vs measured peak, {row['model']}", "2% allocated, 10% reserved",
                            measured, row["within_targets"]))
    return checks


CHECKS: dict[str, Callable[[Part], list[Check]]] = {
    "tests": test_checks,
    "offload": offload_checks,
    "overhead": overhead_checks,
    "memory": memory_checks,
}


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _number(value: Any) -> str:
    return "n/a" if _missing(value) else f"{value:.2f}"


# report ---------------------------------------------------------------------------


def _environment(device: str) -> str:
    import torch

    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "CPU"
    cuda = f", CUDA {torch.version.cuda}" if device == "cuda" else " (dry run on the CPU: no GPU numbers)"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return (f"{datetime.datetime.now():%Y-%m-%d %H:%M}, commit {commit}, torch {torch.__version__}, "
            f"{name}{cuda}, Python {platform.python_version()}")


def _result(passed: bool | None) -> str:
    return "n/a" if passed is None else "pass" if passed else "**FAIL**"


def render(parts: Sequence[Part], device: str, total_s: float) -> str:
    lines = ["# remat GPU check", "", _environment(device), "", "## Summary", "",
             "| check | target | measured | result |", "|---|---|---|---|"]
    for part in parts:
        for check in part.checks:
            lines.append(f"| {check.what} | {check.target} | {check.measured} | {_result(check.passed)} |")
    lines += ["", "| part | status | time |", "|---|---|---|"]
    lines += [f"| {part.name} | {part.status} | {part.elapsed_s:.0f} s |" for part in parts]
    lines += ["", f"Total {total_s:.0f} s.", ""]
    for part in parts:
        lines += [f"## {part.name}", "", f"`{' '.join(Path(arg).name if arg.startswith('/') else arg for arg in part.command)}`",
                  f"({part.status}, {part.elapsed_s:.0f} s)", "", "```", part.output.strip() or "(no output)", "```", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, default=None, help="the report (default: remat-out/gpu-check-<time>.md)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated among {', '.join(PARTS)}")
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.parts.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown parts {unknown}; choose among {list(PARTS)}")
    out = args.out or ROOT / "remat-out" / f"gpu-check-{datetime.datetime.now():%Y%m%d-%H%M%S}.md"
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        parts = [part for part in commands(args.device, Path(folder)) if part.name in chosen]
        for part in parts:
            left = DEADLINE_S[args.device] - (time.perf_counter() - start)
            if left > 5 and not part.not_here:
                print(f"gpu-check: {part.name} ...", file=sys.stderr, flush=True)
                factor = CPU_LIMIT_FACTOR if args.device == "cpu" else 1.0
                run_part(part, min(LIMITS_S[part.name] * factor, left))
            check = CHECKS.get(part.name)
            part.checks = check(part) if check is not None else []
    report = render(parts, args.device, time.perf_counter() - start)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report + "\n")
    print(f"gpu-check: report written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
