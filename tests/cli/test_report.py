"""`remat report`: what a model's forward keeps for backward, on the embedded GPT and a factory."""

from __future__ import annotations

import pytest

from remat.cli import main


def test_report_on_the_embedded_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--layers", "1", "--seq", "16", "--batch", "1", "--strategy", "remat:save_matmuls"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("remat:save_matmuls: GPT 1 layers")
    assert "policy_saved" in out and "dropped" in out and "gpt.py:" in out
    assert out.splitlines()[-1].startswith("totals (parameters excluded): kept ")


def test_report_with_a_factory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--model", "remat.models:tiny_gpt", "--limit", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "none: GPT from remat.models:tiny_gpt"
    assert out[1].split()[0] == "fate" and out[4].endswith("more")


@pytest.mark.parametrize("by", ["module", "tensor"])
def test_report_compress_measures_the_gradient_error(by: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["report", "--layers", "1", "--seq", "16", "--batch", "1", "--compress", "fp8", "--by", by]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "fp8" in out and ("blocks.0" in out if by == "module" else "#0 " in out)


def test_report_compress_refuses_an_unknown_format(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--layers", "1", "--compress", "fp4"]) == 2
    assert "--compress: invalid choice: 'fp4'" in capsys.readouterr().err
