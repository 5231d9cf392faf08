"""``remat plan --estimate DEVICE``: plans made on fake tensors with modelled times."""

from __future__ import annotations

import json
import pathlib

import pytest

from remat._compat.distributed import collectives_run_on_fake_tensors, sharding_api_available
from remat.cli import main
from remat.cli import plan as plan_command

SMALL = ["--layers", "3", "--d-model", "64", "--seq", "64", "--batch", "4"]


def test_an_estimated_plan_says_what_was_estimated_and_is_saved_as_such(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "plan.toml"
    assert main(["plan", "--estimate", "h100", "--budget", "85%", *SMALL, "--save", str(saved), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "planned from estimates" in out and "nothing ran" in out
    assert "estimated, not measured" in out and "h100 (datasheet" in out
    assert "measured peak" not in out  # nothing was run
    assert 'estimated_with = "h100 (datasheet' in saved.read_text()


def test_the_estimated_plan_beside_the_measured_one(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    written = tmp_path / "plans.json"
    argv = ["plan", "--estimate", "here", "--measure", "--budget", "85%", *SMALL, "--steps", "2",
            "--repeats", "1", "--json", str(written), "--quiet"]
    assert main(argv) == 0
    payload = json.loads(written.read_text())
    assert payload["estimated"]["budget_bytes"] == payload["measured"]["budget_bytes"]
    assert payload["estimated"]["estimated_with"].startswith("cpu (measured)")
    assert payload["measured"]["estimated_with"] is None
    assert payload["run"]["estimated"]["peak_bytes"] <= payload["estimated"]["budget_bytes"]
    assert payload["step_time_ratio"] > 0
    out = capsys.readouterr().out
    assert "cpu (measured) (measured here" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("estimated ", "measured "))}
    assert set(rows) == {"estimated", "measured"}
    assert all(" yes " in row for row in rows.values()), out  # both fit when run
    assert "step time, estimated plan / measured plan:" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--measure"], "--measure compares an estimated plan"),
        (["--json", "plan.json"], "--json writes an estimated plan's figures"),
        (["--estimate", "h100", "--compress", "fp8", "--max-gradient-error", "0.1"], "--compress needs measured"),
        (["--estimate", "h100", "--measure", "--world-size", "2", "--fsdp"], "--measure runs the model in this process"),
    ],
)
def test_what_an_estimate_cannot_do_is_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", *argv, *SMALL, "--quiet"]) == 2
    assert message in capsys.readouterr().err


def test_a_model_too_large_to_profile_is_planned_from_estimates(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(plan_command, "_PROFILE_BYTES_PER_PARAMETER", 10**9)  # no machine holds that
    assert main(["plan", "--budget", "85%", *SMALL, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "to profile (parameters, gradients and AdamW state), this machine has" in out
    assert "planning from estimates (--estimate here)" in out and "estimated, not measured" in out


@pytest.mark.skipif(
    not (sharding_api_available() and collectives_run_on_fake_tensors()),
    reason="simulated ranks need FSDP2 and collectives on fake tensors (torch 2.11+)",
)
def test_a_sharded_estimated_plan_runs_on_one_simulated_rank(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--estimate", "a100", "--world-size", "16", "--fsdp", "--mixed-precision", "bf16",
            "--budget", "85%", *SMALL, "--quiet"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "16 ranks: FSDP2 x 16, bf16; budget per rank; one simulated rank stands for all" in out
    assert "estimated, not measured" in out
