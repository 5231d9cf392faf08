"""`remat plan --pipeline S`: one plan for every pipeline rank (remat.cli.plan, remat.planner.pipeline);
the plan measured on gloo processes fits (``--measure``) and is saved as a regions TOML."""

from __future__ import annotations

import pathlib

import pytest

import remat
from remat._compat.distributed import collectives_run_on_fake_tensors
from remat.cli import main

pytestmark = [
    pytest.mark.xdist_group("pipeline-memory"),
    pytest.mark.skipif(not collectives_run_on_fake_tensors(),
                       reason="simulated ranks run collectives on fake tensors: torch 2.11 and newer"),
]


def test_plan_pipeline_fits_every_rank_and_saves(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "plan.toml"
    argv = ["plan", "--pipeline", "2", "--layers", "4", "--d-model", "32", "--seq", "32", "--batch", "4",
            "--microbatches", "2", "--budget", "90%", "--measure", "--save", str(saved), "--quiet"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "1F1B, 2 ranks x 1 stages, 2 microbatches" in printed
    assert "NO" not in printed.split("measured on local CPU processes")[1]
    regions = remat.config_from_toml(saved).regions or {}
    assert sorted(regions) == [f"blocks.{index}" for index in range(4)]
    assert set(regions.values()) <= {"keep", "checkpoint", "checkpoint:save_matmuls"}


def test_plan_pipeline_with_an_unreachable_budget_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--pipeline", "2", "--layers", "2", "--d-model", "32", "--seq", "16", "--batch", "4",
            "--budget", "10000", "--quiet"]
    assert main(argv) == 2
    assert "smallest reachable peak" in capsys.readouterr().err
