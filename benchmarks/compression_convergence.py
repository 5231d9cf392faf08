"""Does training converge with compressed activations? The embedded GPT and a HF Llama, a few hundred steps.

A learnable synthetic task: each sequence counts up from a random start by a
random step (``t[i+1] = t[i] + step mod vocab``, step among a few), so the
next token follows from the last two, except that one token in ten is
replaced by a random one. A model learns it in a few hundred steps, and the
loss falls from ``log(vocab)`` towards the noise's own entropy (about 0.75
nats): a floor every run reaches the same way, so final losses compare (on a
task with no floor they all approach zero, and their ratio measures how the
runs' trajectories diverged, not compression). For each seed, every format
starts from the same weights and sees the same batches; the only difference
is ``remat.compress(format)`` around the forward (``keep``: none). Several
seeds (``--seeds``, other weights and other batches) show how far two runs
drift apart anyway: a difference smaller than that spread is not one the
benchmark can see.

Prints, for each format, the final training loss (mean of the last 20
steps) and the loss of the trained model on 16 held-out batches (no
compression, no gradient: the same sequences for every run, so it measures
the model, not the last batches' noise), means over the seeds, each with its
difference to ``keep``; the held-out difference of each seed; and keep's
own spread across seeds. Draws the first seed's loss curves (``--plot``,
needs matplotlib).

    .venv/bin/python benchmarks/compression_convergence.py [--steps 300] [--seeds 3] [--plot docs/images/compression_convergence.png]
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


def task_batch(seed: int) -> torch.Tensor:
    """Counting sequences: a random start and a random step per row, ``SEQ + 1`` tokens."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(VOCAB, (BATCH, 1), generator=generator)
    stride = torch.randint(1, 5, (BATCH, 1), generator=generator)
    tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    noise = torch.rand(tokens.shape, generator=generator) < NOISE
    return torch.where(noise, torch.randint(VOCAB, tokens.shape, generator=generator), tokens)


def gpt(seed: int) -> tuple[nn.Module, Callable[[nn.Module, torch.Tensor], torch.Tensor]]:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=128, n_heads=4, n_layers=2, d_ff=512))
    return model, lambda m, tokens: lm_loss(m(tokens[:, :-1]), tokens[:, 1:])


def llama(seed: int) -> tuple[nn.Module, Callable[[nn.Module, torch.Tensor], torch.Tensor]]:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ, use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).train()
    return model, lambda m, tokens: m(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss


HELD_OUT = range(10**9, 10**9 + 16)  # batch seeds no training step uses
SEED_STRIDE = 10**6  # training batch seeds: seed * SEED_STRIDE + step


def held_out_loss(model: nn.Module, loss_of: Callable[..., torch.Tensor]) -> float:
    with torch.no_grad():
        return statistics.fmean(float(loss_of(model, task_batch(seed))) for seed in HELD_OUT)


def train(
    build: Callable[[int], tuple[nn.Module, Callable[..., torch.Tensor]]], format: str, steps: int, seed: int
) -> tuple[list[float], float]:
    """The training losses of every step, and the held-out loss at the end."""
    model, loss_of = build(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        tokens = task_batch(seed * SEED_STRIDE + step)
        with remat.compress(format) if format != "keep" else contextlib.nullcontext():
            loss = loss_of(model, tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, held_out_loss(model, loss_of)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--plot", default=None, metavar="OUT.png")
    parser.add_argument("--seeds", type=int, default=3, help="runs per format, other weights and batches")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    # A CPU computes denormal floats on a slow path; flushing them keeps a run that
    # makes some (small weights, long training) from timing that path. On these
    # models it changes little (a GPT step with fp8 compression: 1.05x).
    torch.set_flush_denormal(True)
    builds = {"gpt": gpt, "llama": llama}
    seeds = range(args.seeds)
    # model -> format -> one entry per seed
    curves: dict[str, dict[str, list[list[float]]]] = {}
    held: dict[str, dict[str, list[float]]] = {}
    print(f"{'model':<6} {'format':<9} {'final loss':>11} {'vs keep':>9} {'held-out':>9} {'vs keep':>9}  held-out vs keep, per seed")
    for name in args.models.split(","):
        curves[name], held[name] = {}, {}
        for format in args.formats.split(","):
            runs = [train(builds[name], format, args.steps, seed) for seed in seeds]
            curves[name][format] = [losses for losses, _ in runs]
            held[name][format] = [loss for _, loss in runs]
            final = statistics.fmean(statistics.fmean(c[-20:]) for c in curves[name][format])
            keep = statistics.fmean(statistics.fmean(c[-20:]) for c in curves[name]["keep"])
            eval_loss, eval_keep = statistics.fmean(held[name][format]), statistics.fmean(held[name]["keep"])
            per_seed = " ".join(f"{(a - b) / b:+.2%}" for a, b in zip(held[name][format], held[name]["keep"], strict=True))
            print(f"{name:<6} {format:<9} {final:>11.4f} {(final - keep) / keep:>+9.2%} "
                  f"{eval_loss:>9.4f} {(eval_loss - eval_keep) / eval_keep:>+9.2%}  {per_seed}", flush=True)
        if len(seeds) > 1:
            keeps = held[name]["keep"]
            print(f"{name:<6} keep's held-out loss across seeds: {min(keeps):.4f} to {max(keeps):.4f} "
                  f"(spread {(max(keeps) - min(keeps)) / statistics.fmean(keeps):.2%} of the mean)", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"curves": curves, "held_out": held}, handle)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4), squeeze=False)
        for axis, (name, runs) in zip(axes[0], curves.items(), strict=True):
            for format, per_seed in runs.items():
                losses = per_seed[0]
                smooth = [statistics.fmean(losses[max(0, i - 9) : i + 1]) for i in range(len(losses))]
                axis.plot(smooth, label=format, linewidth=1.2)
            axis.set_yscale("log")
            axis.set_title(f"{name}: training loss (10-step mean, first seed)")
            axis.set_xlabel("step")
            axis.legend()
        figure.tight_layout()
        figure.savefig(args.plot, dpi=110)
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
