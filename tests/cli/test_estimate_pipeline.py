"""`remat estimate --pipeline S`: every pipeline rank's memory (remat.cli.pipelined).

The command's estimate for the loader's models (the embedded GPT, a tiny Llama from
``--hf-config``) equals the same steps measured on gloo processes (``--measure``) within the
3% the library's own test holds it to (``tests/memory/test_pipeline.py``); bad pipelines are
one-line errors. Design: ``docs/design/memory.md`` ("Pipelined training").
"""

from __future__ import annotations

import json
import pathlib

import pytest

from helpers import tiny_llama_config
from remat._compat.distributed import collectives_run_on_fake_tensors
from remat.cli import main

pytestmark = [
    pytest.mark.xdist_group("pipeline-memory"),
    pytest.mark.skipif(not collectives_run_on_fake_tensors(),
                       reason="simulated ranks run collectives on fake tensors: torch 2.11 and newer"),
]


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_estimate_pipeline_matches_the_measured_ranks(model: str, tmp_path: pathlib.Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    source = ["--layers", "4", "--d-model", "32", "--heads", "2", "--seq", "16"]
    if model == "llama":
        path = tmp_path / "llama.json"
        tiny_llama_config(num_hidden_layers=4).to_json_file(path)
        source = ["--hf-config", str(path), "--seq", "16"]
    out = tmp_path / "ranks.json"
    argv = ["estimate", *source, "--batch", "4", "--pipeline", "2", "--schedule", "Interleaved1F1B",
            "--microbatches", "4", "--strategy", "remat", "--measure", "--json", str(out), "--quiet"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Interleaved1F1B, 2 ranks x 2 stages, 4 microbatches" in printed
    ranks = json.loads(out.read_text())["ranks"]
    assert [rank["rank"] for rank in ranks] == [0, 1]
    for rank in ranks:
        assert abs(rank["peak_bytes"] - rank["measured_peak_bytes"]) <= 0.03 * rank["measured_peak_bytes"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--pipeline", "2", "--batch", "3", "--microbatches", "2"], "does not split into 2 microbatches"),
    (["--schedule", "1F1B"], "give --pipeline S too"),
    (["--pipeline", "2", "--batch", "4", "--world-size", "4", "--fsdp", "--tp", "2"], "drop --fsdp"),
    (["--pipeline", "2", "--batch", "4", "--world-size", "6", "--tp", "2"], "a multiple of 4"),
    (["--pipeline", "2", "--batch", "4", "--world-size", "4"], "give --fsdp"),
    (["--pipeline", "2", "--batch", "4", "--world-size", "3", "--fsdp"], "a multiple of 2"),
    (["--pipeline", "2", "--batch", "4", "--mixed-precision", "bf16"], "set how FSDP2 shards each stage"),
    (["--model", "mlp", "--pipeline", "2", "--batch", "4", "--microbatches", "2"], "cuts a decoder into stages"),
])
def test_bad_pipelines_are_one_line_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", *argv]) == 2
    assert message in capsys.readouterr().err
