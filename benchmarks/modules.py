"""Module-level checkpointing forms on the embedded GPT, against torch's wrapper.

Every transformer block of ``remat.models.GPT`` (default config) is
checkpointed in each of these ways; each form has its own copy of the same
weights:

* ``none``: no checkpointing (reference);
* ``torch wrapper``: torch's ``apply_activation_checkpointing`` + ``checkpoint_wrapper``;
* ``torch composable``: ``torch.distributed._composable.checkpoint`` on each block;
* ``remat wrapper``: ``remat.nn.apply_activation_checkpointing``;
* ``remat composable``: ``remat.composable.checkpoint_module`` on each block;
* ``remat function``: ``model(idx, checkpoint_fn=remat.checkpoint)``.

Memory: live tensor bytes at the end of the forward and the step's peak,
from ``remat.memory.track`` (one tracked step per form: the counts are
deterministic). Time: one training step (forward, loss, backward), untracked,
forms interleaved round by round; the ratio column is the median of per-round
ratios to ``torch wrapper``.

    .venv/bin/python benchmarks/modules.py [--batch N] [--rounds N] [--warmup N]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as torch_wrapper
from torch import nn
from torch.distributed._composable import checkpoint as torch_checkpoint_module

import remat
from remat.composable import checkpoint_module
from remat.memory import track
from remat.models import GPT, Block, GPTConfig, lm_loss, make_batch
from remat.nn import apply_activation_checkpointing

Step = Callable[[], None]


def _forms(
    model: GPT, idx: torch.Tensor, targets: torch.Tensor
) -> dict[str, tuple[GPT, Step, Step]]:
    """name -> (model, forward-only step for memory marks, full training step)."""

    def is_block(module: nn.Module) -> bool:
        return isinstance(module, Block)

    def build(name: str) -> GPT:
        copy_ = copy.deepcopy(model)
        if name == "torch wrapper":
            torch_wrapper.apply_activation_checkpointing(copy_, check_fn=is_block)
        elif name == "torch composable":
            for block in copy_.blocks:
                torch_checkpoint_module(block)
        elif name == "remat wrapper":
            apply_activation_checkpointing(copy_, auto_wrap_policy={Block})
        elif name == "remat composable":
            for block in copy_.blocks:
                checkpoint_module(block)
        return copy_

    names = (
        "none",
        "torch wrapper",
        "torch composable",
        "remat wrapper",
        "remat composable",
        "remat function",
    )
    forms = {}
    for name in names:
        module = build(name)
        checkpoint_fn = remat.checkpoint if name == "remat function" else None

        def forward(
            module: GPT = module, checkpoint_fn: Callable[..., torch.Tensor] | None = checkpoint_fn
        ) -> torch.Tensor:
            return module(idx, checkpoint_fn=checkpoint_fn)

        def step(module: GPT = module, forward: Callable[[], torch.Tensor] = forward) -> None:
            module.zero_grad(set_to_none=True)
            lm_loss(forward(), targets).backward()

        forms[name] = (module, forward, step)
    return forms


def measure(batch: int, rounds: int, warmup: int) -> list[tuple[str, int, int, float, float]]:
    torch.manual_seed(0)
    config = GPTConfig()
    model = GPT(config)
    idx, targets = make_batch(config, batch, torch.Generator().manual_seed(0))
    forms = _forms(model, idx, targets)
    memory = {}
    for name, (module, forward, _) in forms.items():
        module.zero_grad(set_to_none=True)
        with track() as tracker:
            logits = forward()
            tracker.mark("forward_end")
            lm_loss(logits, targets).backward()
            del logits
        memory[name] = (tracker.marks["forward_end"], tracker.peak_bytes)
    times: dict[str, list[float]] = {name: [] for name in forms}
    for round_ in range(warmup + rounds):
        for name, (_, _, step) in forms.items():
            start = time.perf_counter()
            step()
            if round_ >= warmup:
                times[name].append(time.perf_counter() - start)
    base = times["torch wrapper"]
    rows = []
    for name in forms:
        ratio = statistics.median(t / b for t, b in zip(times[name], base, strict=True))
        rows.append((name, *memory[name], statistics.median(times[name]), ratio))
    return rows


def render(rows: list[tuple[str, int, int, float, float]], base_bytes: int) -> str:
    header = f"{'form':<18}{'fwd-end MiB':>12}{'vs torch':>10}{'peak MiB':>10}{'step ms':>10}{'time vs torch':>15}"
    lines = [header, "-" * len(header)]
    for name, forward_end, peak, seconds, ratio in rows:
        lines.append(
            f"{name:<18}{forward_end / 2**20:>12.2f}{forward_end / base_bytes:>10.3f}"
            f"{peak / 2**20:>10.2f}{seconds * 1e3:>10.1f}{ratio:>15.3f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    rows = measure(args.batch, args.rounds, args.warmup)
    base_bytes = next(row[1] for row in rows if row[0] == "torch wrapper")
    print(
        f"GPT default config, batch {args.batch}, {args.rounds} rounds (+{args.warmup} warm-up), "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(render(rows, base_bytes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
