"""`remat plan`: one parser with the other commands, the budget read first, plans for the
embedded GPT, a factory, the head in slices, a Hugging Face model and two FSDP2 ranks."""

from __future__ import annotations

import pathlib

import pytest
import torch

import remat
from helpers import tiny_llama_config
from remat._compat.distributed import sharding_api_available
from remat.cli import main
from remat.models import MLPChain


def plan_main(argv: list[str]) -> int:
    """``remat plan ARGV``: the command's exit status."""
    return main(["plan", *argv])


def test_plan_is_a_subcommand_like_the_others(capsys: pytest.CaptureFixture[str]) -> None:
    # One parser for every command: `remat plan` reads the same model and
    # sharding arguments as `remat estimate` (defined once, remat.cli.arguments).
    assert main(["plan", "--help"]) == 0
    text = capsys.readouterr().out
    for flag in ("--model", "--hf-config", "--freeze", "--lora", "--world-size", "--fsdp", "--save"):
        assert flag in text, flag
    assert main(["plan", "--budget", "50%", "--no-such-flag"]) == 2
    assert "remat: error: unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_plan_reads_the_budget_before_building_a_model(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # One reading of a budget (remat.planner.Budget), for the command too.
    import remat.cli.plan as plan_command

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the budget is read before the model is built")

    monkeypatch.setattr(plan_command, "load_model", no_model)
    assert main(["plan", "--budget", "lots"]) == 2  # a usage error
    assert "cannot read 'lots'" in capsys.readouterr().err


def test_command(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--budget", "50%", "--layers", "3", "--d-model", "32", "--seq", "128", "--batch", "2",
            "--repeats", "1", "--steps", "1"]
    assert plan_main(argv) == 0
    out = capsys.readouterr().out
    assert "blocks.2" in out and "measured" in out and "within budget" in out
    assert plan_main(["--budget", "100"]) == 2
    assert "smallest reachable peak" in capsys.readouterr().err
    # A model that cannot be loaded exits 1; a malformed spec is a usage error, 2.
    assert plan_main(["--model", "no_such_module_xyz:factory"]) == 1
    assert "cannot import" in capsys.readouterr().err
    assert plan_main(["--model", "remat.models"]) == 2
    assert "package.module:factory" in capsys.readouterr().err


def factory() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return MLPChain(widths=(8, 32, 8)), torch.randn(8, 8)


def test_command_user_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_main(["--model", f"{__name__}:factory", "--budget", "100%", "--repeats", "1",
                      "--steps", "1"]) == 0
    assert "blocks.1" in capsys.readouterr().out


def test_command_plans_the_head(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--budget", "60%", "--layers", "2", "--d-model", "32", "--seq", "64", "--batch", "2",
            "--repeats", "1", "--steps", "1", "--head"]
    assert plan_main(argv) == 0
    out = capsys.readouterr().out
    assert "head head: " in out and "within budget" in out
    assert plan_main(["--model", "mlp", "--head", "--budget", "50%"]) == 2
    assert "--head needs" in capsys.readouterr().err


def test_command_plans_a_hugging_face_head(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    config = tiny_llama_config(vocab_size=2048, num_hidden_layers=2, max_position_embeddings=128)
    config.save_pretrained(tmp_path)
    argv = ["--hf-config", str(tmp_path), "--budget", "40%", "--seq", "64", "--batch", "2",
            "--repeats", "1", "--steps", "1", "--head"]
    assert plan_main(argv) == 0
    out = capsys.readouterr().out
    assert "head lm_head: loss in" in out and "within budget" in out


needs_sharding = pytest.mark.skipif(
    not sharding_api_available(), reason="FSDP2 is public from torch 2.6"
)


@needs_sharding
def test_remat_plan_for_two_fsdp2_ranks(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_path = tmp_path / "llama.json"
    tiny_llama_config().to_json_file(config_path)
    saved = tmp_path / "plan.toml"
    status = plan_main([
        "--hf-config", str(config_path), "--seq", "32", "--batch", "2", "--budget", "65%",
        "--world-size", "2", "--fsdp", "--repeats", "1", "--steps", "1", "--save", str(saved),
        "--quiet",
    ])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "2 ranks: FSDP2 x 2; budget per rank" in out
    assert "within budget on every rank" in out
    rows = [line.split() for line in out.splitlines() if line[:2] in ("0 ", "1 ")]
    assert [row[0] for row in rows] == ["0", "1"] and all(row[-1] == "yes" for row in rows)
    text = saved.read_text()
    assert "world_size = 2" in text
    regions = remat.config_from_toml(saved).regions
    assert regions is not None and set(regions) == {f"model.layers.{i}" for i in range(3)}
    assert any(option != "keep" for option in regions.values())
