"""The commands' compiled forms: ``remat plan --compile`` and ``remat estimate --compile``."""

from __future__ import annotations

import json
import pathlib

import pytest

from remat.cli import main
from remat.config import config_from_toml
from remat.placement import CompileSpec

pytestmark = [pytest.mark.compile, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

SMALL = ["--layers", "2", "--d-model", "64", "--seq", "32", "--batch", "2"]


def test_plan_compile_measures_the_compiled_plan_and_saves_how_it_compiles(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "plan.toml"
    argv = ["plan", "--compile", "--budget", "95%", *SMALL, "--repeats", "1", "--steps", "1",
            "--save", str(saved), "--quiet"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "within budget" in out and "peak: predicted" in out
    assert config_from_toml(saved).compile == CompileSpec()


def test_estimate_compile_says_why_it_must_measure(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--compile", "--layers", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("remat estimate: error:")
    assert "cannot be estimated without allocating" in err[0] and "--measure" in err[0]
    assert main(["estimate", "--compile", "--measure", "--world-size", "2", "--fsdp"]) == 2
    assert "remat plan --compile --world-size" in capsys.readouterr().err


def test_estimate_compile_measure_runs_one_compiled_step(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "estimate.json"
    argv = ["estimate", "--compile", "--measure", "--layers", "2", "--seq", "32", "--strategy",
            "remat", "--json", str(out_json), "--quiet"]
    assert main(argv) == 0
    assert "each block compiled (fullgraph, inductor)" in capsys.readouterr().out
    payload = json.loads(out_json.read_text())
    assert payload["compiled"] is True
    assert payload["peak_bytes"] >= payload["forward_end_bytes"] > payload["resident_bytes"] > 0
