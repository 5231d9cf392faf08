"""Checkpointing under torch.func: peak memory and time, unchecked against remat.

Rows, each variant (no checkpointing, full checkpointing, a selective policy
saving the matmuls) run interleaved round by round in one process, medians
over the rounds:

* **per-sample gradients** (``vmap(grad)``) of the embedded GPT at a
  long-ish sequence, every block a region (``checkpoint_fn``);
* **hessian** (``jacfwd(jacrev)``) of a small MLP's loss with respect to
  its input, the MLP one region;
* **plain autograd** of the same GPT batch (``loss.backward()``), for
  comparison: the activation-byte cut remat makes without any transform.

Peak bytes are the allocator's (``remat.memory.track_allocations``: every
allocation inside the block, functorch's included); "held at forward end"
is what was alive when the loss was computed, before any backward, relative
to the start. Times are wall-clock seconds on this machine.

    .venv/bin/python benchmarks/func_transforms.py [--rounds N] [--seq N]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, hessian, vmap

import remat
from remat.memory import track_allocations
from remat.models import GPT, GPTConfig
from remat.policies import save_matmuls

VARIANTS: dict[str, Callable[..., Any] | None] = {
    "unchecked": None,
    "full": remat.checkpoint,
    "save_matmuls": functools.partial(remat.checkpoint, policy=save_matmuls),
}


def _gpt(seq: int) -> tuple[GPT, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, seq_len=seq, d_model=64, n_heads=4, n_layers=8, d_ff=256)
    model = GPT(config)
    params = {name: p.detach() for name, p in model.named_parameters()}
    tokens = torch.randint(0, config.vocab_size, (4, seq))
    targets = torch.randint(0, config.vocab_size, (4, seq))
    return model, params, tokens, targets


def per_sample(model: GPT, params: dict[str, torch.Tensor], tokens: torch.Tensor, targets: torch.Tensor,
               checkpoint_fn: Callable[..., Any] | None, meter: Any) -> None:
    def example_loss(p: dict[str, torch.Tensor], t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, p, (t[None],), {"checkpoint_fn": checkpoint_fn})
        loss = F.cross_entropy(logits[0], y)
        meter.mark("forward_end")
        return loss

    vmap(grad(example_loss), in_dims=(None, 0, 0))(params, tokens, targets)


def plain_autograd(model: GPT, params: dict[str, torch.Tensor], tokens: torch.Tensor, targets: torch.Tensor,
                   checkpoint_fn: Callable[..., Any] | None, meter: Any) -> None:
    logits = model(tokens, checkpoint_fn=checkpoint_fn)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    meter.mark("forward_end")
    loss.backward()
    model.zero_grad(set_to_none=True)


def mlp_hessian(checkpoint_fn: Callable[..., Any] | None, meter: Any) -> None:
    torch.manual_seed(1)
    layers: list[torch.nn.Module] = [torch.nn.Linear(16, 256), torch.nn.Tanh()]
    for _ in range(5):
        layers += [torch.nn.Linear(256, 256), torch.nn.Tanh()]
    mlp = torch.nn.Sequential(*layers, torch.nn.Linear(256, 1))
    batch = torch.randn(256, 16)

    def loss(x: torch.Tensor) -> torch.Tensor:
        run = lambda inputs: mlp(inputs * x)  # noqa: E731
        out = run(batch) if checkpoint_fn is None else checkpoint_fn(run, batch)
        total = out.pow(2).sum()
        meter.mark("forward_end")
        return total

    hessian(loss)(torch.ones(16))


def measure(run: Callable[[Any], None]) -> tuple[float, int, int]:
    start = time.perf_counter()
    with track_allocations(quiet=True) as meter:
        run(meter)
    seconds = time.perf_counter() - start
    return seconds, meter.peak_bytes, meter.marks.get("forward_end", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    model, params, tokens, targets = _gpt(args.seq)
    rows: dict[str, Callable[[Callable[..., Any] | None, Any], None]] = {
        f"per-sample grads, GPT seq {args.seq} (vmap(grad))": functools.partial(
            lambda fn, m, **kw: per_sample(model, params, tokens, targets, fn, m)
        ),
        "hessian, MLP 6x256, batch 256, 16 inputs (jacfwd(jacrev))": mlp_hessian,
        f"plain autograd, GPT seq {args.seq} (loss.backward())": functools.partial(
            lambda fn, m, **kw: plain_autograd(model, params, tokens, targets, fn, m)
        ),
    }
    print(f"torch {torch.__version__}, {args.rounds} rounds, medians")
    print("| workload | variant | peak MiB | held at forward end MiB | time s | peak vs unchecked |")
    print("|---|---|---|---|---|---|")
    for label, row in rows.items():
        found: dict[str, list[tuple[float, int, int]]] = {name: [] for name in VARIANTS}
        for _ in range(args.rounds):
            for name, checkpoint_fn in VARIANTS.items():
                found[name].append(measure(functools.partial(row, checkpoint_fn)))
        base = statistics.median(peak for _, peak, _ in found["unchecked"])
        for name, runs in found.items():
            seconds = statistics.median(s for s, _, _ in runs)
            peak = statistics.median(p for _, p, _ in runs)
            held = statistics.median(h for _, _, h in runs)
            print(
                f"| {label} | {name} | {peak / 2**20:.1f} | {held / 2**20:.1f} | {seconds:.2f} | {peak / base:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
