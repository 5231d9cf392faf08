"""Compressed activations on the embedded GPT and a HF Llama: bytes, gradient error, time.

For each model, in float32 and under bf16 autocast, one training step with the
whole forward under ``remat.compress(format)`` for every format, against the
plain step (``keep``):

* ``end of fwd``: live tensor bytes at the end of the forward (parameters
  and inputs excluded: what the step itself holds), measured by
  :func:`remat.memory.track`, and its ratio to ``keep``;
* ``predicted``: the same from shapes alone: ``keep``'s bytes minus the
  storages of the tensors ``remat.compress`` takes, plus what each format
  makes of them (:func:`remat.memory.compression_report`'s census), and the
  difference to the measurement;
* ``saved of compressed``: ``1 - stored / original`` over the compressed
  tensors, as the compressed stash counted them, and over the bf16 ones
  alone (under autocast);
* ``grad err`` / ``cosine``: ``||g - g_keep|| / ||g_keep||`` over every
  parameter gradient, and their cosine similarity;
* ``step``: median step time over interleaved rounds, and its ratio to ``keep``.

    .venv/bin/python benchmarks/compression.py [--rounds N] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

import remat
from remat.compression import FORMATS
from remat.memory import compression_report, track
from remat.models import GPT, GPTConfig, lm_loss, make_batch

COLUMNS = ("model", "precision", "format", "end of fwd", "vs keep", "predicted", "pred. diff",
           "saved of compressed", "of bf16 ones", "grad err", "cosine", "step ms", "step vs keep")


@dataclass
class Row:
    model: str
    precision: str
    format: str
    forward_end_bytes: int
    ratio: float
    predicted_bytes: int
    predicted_difference: float
    saved_of_compressed: float
    saved_of_bf16: float | None
    gradient_error: float
    cosine: float
    step_s: float
    step_ratio: float


def gpt_case(quick: bool) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    config = GPTConfig(n_layers=2 if quick else 4, seq_len=128 if quick else 256, d_model=128, n_heads=4, d_ff=512)
    torch.manual_seed(0)
    model = GPT(config)
    idx, targets = make_batch(config, 4, torch.Generator().manual_seed(0))
    return model, lambda: lm_loss(model(idx).float(), targets)


def llama_and_tokens(layers: int, quick: bool) -> tuple[nn.Module, torch.Tensor]:
    """A HF Llama config (width 128, GQA, vocabulary 256), seeded, and a batch of 4 token rows."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    tokens = torch.randint(256, (4, 129 if quick else 257), generator=torch.Generator().manual_seed(0))
    return model, tokens


def llama_case(quick: bool) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    model, tokens = llama_and_tokens(2 if quick else 4, quick)
    return model, lambda: model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss


def autocast(precision: str) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16 autocast")


def forward_end(model: nn.Module, loss: Callable[[], torch.Tensor], precision: str, format: str | None) -> int:
    """Live bytes the step holds at the end of its forward (the loss computed)."""
    block = remat.compress(format) if format else contextlib.nullcontext()
    with track() as tracker:
        with autocast(precision), block:
            value = loss()
        held = tracker.live_bytes
    del value
    return held


def gradients(model: nn.Module, loss: Callable[[], torch.Tensor], precision: str, format: str | None) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    block = remat.compress(format) if format else contextlib.nullcontext()
    with autocast(precision):
        with block:
            value = loss()
        value.backward()
    grads = torch.cat([p.grad.detach().double().flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return grads


def step_times(model: nn.Module, loss: Callable[[], torch.Tensor], precision: str, rounds: int) -> dict[str, float]:
    """Median step time per format, the formats interleaved round by round."""
    times: dict[str, list[float]] = {name: [] for name in ("keep", *FORMATS)}
    for round_ in range(rounds + 1):
        for name in times:
            model.zero_grad(set_to_none=True)
            started = time.perf_counter()
            with autocast(precision):
                with remat.compress(name) if name != "keep" else contextlib.nullcontext():
                    value = loss()
                value.backward()
            if round_:  # the first round warms up
                times[name].append(time.perf_counter() - started)
    model.zero_grad(set_to_none=True)
    return {name: statistics.median(values) for name, values in times.items()}


def measure(name: str, case: tuple[nn.Module, Callable[[], torch.Tensor]], precision: str, rounds: int) -> list[Row]:
    model, loss = case

    def scaled_loss() -> torch.Tensor:
        with autocast(precision):
            return loss()

    # What each format would take, from shapes (its own rule: bf16 takes float32 tensors only).
    census = {f: compression_report(model, scaled_loss, f, per_group=False, formats=(f,)) for f in FORMATS}
    keep_bytes = forward_end(model, loss, precision, None)
    reference = gradients(model, loss, precision, None)
    times = step_times(model, loss, precision, rounds)
    rows = [Row(name, precision, "keep", keep_bytes, 1.0, keep_bytes, 0.0, 0.0, None, 0.0, 1.0, times["keep"], 1.0)]
    for format in FORMATS:
        measured = forward_end(model, loss, precision, format)
        predicted = keep_bytes - census[format].predicted_original_bytes + census[format].predicted_stored_bytes[format]
        with autocast(precision), remat.compress(format) as block:
            loss().detach()
        saved = 1 - block.stored_bytes / block.original_bytes if block.original_bytes else 0.0
        bf16 = block.bytes_by_dtype.get(torch.bfloat16)
        saved_bf16 = 1 - bf16[1] / bf16[0] if bf16 else None
        grads = gradients(model, loss, precision, format)
        rows.append(Row(
            name, precision, format, measured, measured / keep_bytes, predicted,
            (measured - predicted) / max(predicted, 1), saved, saved_bf16,
            float((grads - reference).norm() / reference.norm()),
            float(torch.nn.functional.cosine_similarity(grads, reference, dim=0)),
            times[format], times[format] / times["keep"],
        ))
    return rows


def render(rows: list[Row]) -> str:
    def mib(value: int) -> str:
        return f"{value / 2**20:.2f} MiB"

    cells = [
        (r.model, r.precision, r.format, mib(r.forward_end_bytes), f"{r.ratio:.2f}x", mib(r.predicted_bytes),
         f"{r.predicted_difference:+.2%}", f"{r.saved_of_compressed:.1%}" if r.format != "keep" else "-",
         "-" if r.saved_of_bf16 is None else f"{r.saved_of_bf16:.1%}",
         f"{r.gradient_error:.2e}", f"{r.cosine:.6f}", f"{r.step_s * 1e3:.1f}", f"{r.step_ratio:.2f}x")
        for r in rows
    ]
    widths = [max(len(str(c)) for c in column) for column in zip(COLUMNS, *cells, strict=True)]
    lines = ["  ".join(f"{c:<{w}}" for c, w in zip(COLUMNS, widths, strict=True))]
    lines += ["  ".join(f"{c:<{w}}" for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per format (default 5)")
    parser.add_argument("--quick", action="store_true", help="smaller models, for a test")
    parser.add_argument("--json", default=None, help="also write the rows as JSON")
    parser.add_argument("--models", default="gpt,llama", help="comma-separated: gpt, llama")
    args = parser.parse_args(argv)
    # A CPU computes denormal floats on a slow path; flushing them keeps a run that
    # makes some (small weights, long training) from timing that path. On these
    # models it changes little (a GPT step with fp8 compression: 1.05x).
    torch.set_flush_denormal(True)
    cases = {"gpt": gpt_case, "llama": llama_case}
    rows: list[Row] = []
    for name in args.models.split(","):
        for precision in ("fp32", "bf16 autocast"):
            rows += measure(name, cases[name](args.quick), precision, args.rounds)
    print(render(rows))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([asdict(row) for row in rows], handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
