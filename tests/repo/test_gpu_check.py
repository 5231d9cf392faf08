"""scripts/gpu-check.sh and the report pipeline behind it (benchmarks/gpu_check.py), on the CPU.

Without a GPU the script says so and exits 0; the pipeline itself runs on the
CPU with small sizes (``--device cpu``), so every part but the planner (too
slow for a CPU test) and every check is exercised here.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from helpers import REPO


def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU answer")
def test_without_cuda_the_script_says_so_in_one_line_and_exits_0() -> None:
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu-check.sh")], capture_output=True, text=True, timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0]


def test_the_report_pipeline_runs_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--device", "cpu",
         "--parts", "tests,offload,overhead,memory", "--out", str(out)],
        capture_output=True, text=True, timeout=1200,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == f"gpu-check: report written to {out}"
    report = out.read_text()
    for section in ("# remat GPU check", "## Summary", "## tests", "## offload", "## overhead", "## memory"):
        assert section in report
    summary = report.split("## tests")[0]
    assert "| CUDA test group (pytest -m cuda) | no failures |" in summary
    assert "| remat offload+ckpt: copy time hidden | >= 0.8 | n/a" in summary  # no overlap on a CPU
    assert "SAC step vs full checkpoint step, GPT" in summary
    assert summary.count("| estimated vs measured peak,") == 2
    assert "| memory | ok |" in summary and "| offload | ok |" in summary and "| overhead | ok |" in summary
    assert "| tests | ok |" in summary  # the CUDA test file it collects exists (and skips here)


def test_checks_read_the_benchmarks_numbers() -> None:
    module = gpu_check()
    part = module.Part("offload", [], data={"rows": [
        {"form": "remat offload", "hidden_fraction": 0.91},
        {"form": "remat offload+ckpt", "hidden_fraction": 0.42},
    ]})
    checks = {check.what: check for check in module.offload_checks(part)}
    assert checks["remat offload: copy time hidden"].passed is True
    assert checks["remat offload+ckpt: copy time hidden"].passed is False
    assert checks["remat policy offload: copy time hidden"].passed is None  # not in the rows

    part = module.Part("overhead", [], data={"rows": [
        {"what": "full checkpoint step, GPT d2048 L12 s1024 b4 bf16", "remat": 1.31, "torch": 1.33, "ratio": 0.98},
        {"what": "SAC save-matmuls step, GPT d2048 L12 s1024 b4 bf16", "remat": 1.12, "torch": 1.2, "ratio": 0.93},
        {"what": "full checkpoint step, GPT d1024 L12 s1024 b8 bf16", "remat": 1.2, "torch": 1.2, "ratio": 1.0},
        {"what": "SAC save-matmuls step, GPT d1024 L12 s1024 b8 bf16", "remat": 1.25, "torch": 1.3, "ratio": 0.96},
        {"what": "per-region overhead, 1-parameter blocks x + 0.5 tanh(x @ W), full", "remat": 4.0,
         "torch": 10.0, "ratio": 0.4},
    ]})
    results = [check.passed for check in module.overhead_checks(part)]
    assert results == [True, True, False]

    part = module.Part("memory", [], data={"rows": [
        {"model": "a", "allocated_error": 0.015, "reserved_error": 0.08, "within_targets": True},
        {"model": "b", "allocated_error": 0.03, "reserved_error": None, "within_targets": False},
    ]})
    assert [check.passed for check in module.memory_checks(part)] == [True, False]

    part = module.Part("tests", [], returncode=1, output="3 failed, 5 passed in 2.0s")
    (check,) = module.test_checks(part)
    assert check.passed is False and check.measured == "3 failed, 5 passed in 2.0s"


def test_a_part_this_torch_cannot_run_is_reported_not_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The compiled planner needs per-region compile budgets (torch 2.13+); under an older
    # torch (the GPU machine's was 2.11) the part is not started and says why, rather than
    # reading as a failure.
    import remat._compat.partitioner

    monkeypatch.setattr(remat._compat.partitioner, "region_memory_budgets_available", lambda: False)
    module = gpu_check()
    out = tmp_path / "report.md"
    assert module.main(["--device", "cpu", "--parts", "compiled", "--out", str(out)]) == 0
    report = out.read_text()
    assert f"| compiled | not run: torch {torch.__version__} has no per-region compile budgets (2.13 or newer) |" in report
