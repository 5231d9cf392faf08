"""Does training converge with compressed activations? The embedded GPT and a HF Llama, a few hundred steps.

A learnable synthetic task: each sequence counts up from a random start by a
random step (``t[i+1] = t[i] + step mod vocab``, step among a few), so the
next token follows from the last two, except that one token in ten is
replaced by a random one. A model learns it in a few hundred steps, and the
loss falls from ``log(vocab)`` towards the noise's own entropy (about 0.75
nats): a floor every run reaches the same way, so final losses compare (on a
task with no floor they all approach zero, and their ratio measures how the
runs' trajectories diverged, not compression). Every run starts
from the same weights and sees the same batches; the only difference is
``remat.compress(format)`` around the forward (``keep``: none).

Prints the final loss (mean of the last 20 steps) of each run and its
difference to ``keep``, and draws the loss curves (``--plot``, needs
matplotlib).

    .venv/bin/python benchmarks/compression_convergence.py [--steps 300] [--plot docs/images/compression_convergence.png]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from collections.abc import Callable

import torch
from torch import nn

import remat
from remat.models import GPT, GPTConfig, lm_loss

VOCAB = 64
SEQ = 64
BATCH = 16
NOISE = 0.1
FORMATS = ("keep", "bf16", "fp8", "int8", "fp8_e5m2")


def task_batch(step: int) -> torch.Tensor:
    """Counting sequences: a random start and a random step per row, ``SEQ + 1`` tokens."""
    generator = torch.Generator().manual_seed(step)
    start = torch.randint(VOCAB, (BATCH, 1), generator=generator)
    stride = torch.randint(1, 5, (BATCH, 1), generator=generator)
    tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    noise = torch.rand(tokens.shape, generator=generator) < NOISE
    return torch.where(noise, torch.randint(VOCAB, tokens.shape, generator=generator), tokens)


def gpt() -> tuple[nn.Module, Callable[[nn.Module, torch.Tensor], torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=128, n_heads=4, n_layers=2, d_ff=512))
    return model, lambda m, tokens: lm_loss(m(tokens[:, :-1]), tokens[:, 1:])


def llama() -> tuple[nn.Module, Callable[[nn.Module, torch.Tensor], torch.Tensor]]:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ, use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    return model, lambda m, tokens: m(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss


def train(build: Callable[[], tuple[nn.Module, Callable[..., torch.Tensor]]], format: str, steps: int) -> list[float]:
    model, loss_of = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        tokens = task_batch(step)
        with remat.compress(format) if format != "keep" else contextlib.nullcontext():
            loss = loss_of(model, tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--plot", default=None, metavar="OUT.png")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    # The embedded GPT's small initial weights make denormal floats in its backward,
    # which a CPU computes on a slow path (a step 25x slower): time the work, not that.
    torch.set_flush_denormal(True)
    builds = {"gpt": gpt, "llama": llama}
    curves: dict[str, dict[str, list[float]]] = {}
    print(f"{'model':<6} {'format':<9} {'final loss':>11} {'vs keep':>9}")
    for name in args.models.split(","):
        curves[name] = {}
        for format in args.formats.split(","):
            curves[name][format] = train(builds[name], format, args.steps)
            final = statistics.fmean(curves[name][format][-20:])
            keep = statistics.fmean(curves[name]["keep"][-20:])
            print(f"{name:<6} {format:<9} {final:>11.4f} {(final - keep) / keep:>+9.2%}", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(curves, handle)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4), squeeze=False)
        for axis, (name, runs) in zip(axes[0], curves.items(), strict=True):
            for format, losses in runs.items():
                smooth = [statistics.fmean(losses[max(0, i - 9) : i + 1]) for i in range(len(losses))]
                axis.plot(smooth, label=format, linewidth=1.2)
            axis.set_yscale("log")
            axis.set_title(f"{name}: training loss (10-step mean)")
            axis.set_xlabel("step")
            axis.legend()
        figure.tight_layout()
        figure.savefig(args.plot, dpi=110)
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
