"""Where remat is meant to be faster than torch: per-region and per-op cost, SAC steps.

One command, one table, remat vs torch vs no checkpointing, on regions as
users write them:

* **per-region overhead** of a chain of checkpointed regions, forward and
  backward: (step time - the same chain without checkpointing) / regions,
  under full checkpointing and under "save matmuls" selective checkpointing
  (remat ``policies.save_matmuls`` vs torch's
  ``create_selective_checkpoint_contexts`` with the same ops). The regions:

  - blocks with one parameter, ``x + 0.5 * tanh(x @ W)``;
  - residual MLP blocks with six parameters, ``x + Linear(GELU(Linear(LayerNorm(x))))``;
  - transformer blocks of the embedded GPT (``remat.models.Block``, twelve
    parameters: attention and MLP);
  - a function with no parameters (``x * 2 + 1`` on a 16x16 tensor), full
    checkpointing only: the floor of a region's cost;
  - on the 1-parameter blocks, full checkpointing plus a dispatch mode that
    only runs each op, against torch's save-matmuls form: the floor of any
    selective checkpointing built on Python dispatch modes, remat's included;
    and remat's save matmuls against that floor, round by round;

* **SAC per-op overhead**: one region of many small ``(x @ w).tanh()`` steps
  under "save matmuls", per op;
* **GPT steps**: the embedded GPT under full checkpointing and under "save
  matmuls", as step-time ratios to no checkpointing (remat and torch), plus
  remat's ratio to torch.

Every variant of a row runs interleaved round by round in one process; the
ratio column is the median of per-round ratios remat / torch. CPU sizes by
default; ``--device cuda`` runs the chains at the same sizes (the per-region
cost is host-side) and the GPT steps at GPU sizes (GPT d2048
L12 seq 1024 batch 4 and GPT d1024 L12 seq 1024 batch 8, bf16 autocast), both
forms at both sizes, timed with ``torch.cuda.synchronize``. ``--only TEXT`` runs the rows
whose name contains TEXT.

    .venv/bin/python benchmarks/overhead.py [--quick] [--rounds N] [--device cuda] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat.models import GPT, Block, GPTConfig, lm_loss, make_batch
from remat.policies import MATMUL_OPS, save_matmuls


@dataclass(frozen=True)
class Row:
    what: str
    remat: float
    torch: float
    unit: str
    ratio: float  # remat / torch, median of per-round ratios


def _timer(device: str) -> Callable[[Callable[[], object]], float]:
    def run(step: Callable[[], object]) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    return run


def _interleaved(
    steps: dict[str, Callable[[], object]], rounds: int, warmup: int, device: str
) -> dict[str, list[float]]:
    timed = _timer(device)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(warmup + rounds):
        for name, step in steps.items():
            elapsed = timed(step)
            if round_ >= warmup:
                times[name].append(elapsed)
    return times


# torch gained selective checkpointing in 2.5: before it, torch's SAC columns are n/a.
_TORCH_SAC = getattr(torch_checkpoint, "create_selective_checkpoint_contexts", None)


def _torch_sac_context() -> Callable[[], object] | None:
    if _TORCH_SAC is None:
        return None
    return functools.partial(_TORCH_SAC, sorted(MATMUL_OPS, key=str))


def _checkpoint_forms() -> dict[str, Callable[..., torch.Tensor] | None]:
    """The forms every row compares: none, remat and torch, full and save-matmuls
    (torch's selective form only where torch has it)."""
    forms: dict[str, Callable[..., torch.Tensor] | None] = {
        "none": None,
        "remat full": remat.checkpoint,
        "torch full": functools.partial(torch_checkpoint.checkpoint, use_reentrant=False),
        "remat sac": functools.partial(remat.checkpoint, policy=save_matmuls),
    }
    torch_context = _torch_sac_context()
    if torch_context is not None:
        forms["torch sac"] = functools.partial(
            torch_checkpoint.checkpoint, use_reentrant=False, context_fn=torch_context
        )
    return forms


class TanhBlock(nn.Module):
    """One parameter: ``x + 0.5 * tanh(x @ W)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.5 * torch.tanh(x @ self.weight)


class MLPBlock(nn.Module):
    """Six parameters: ``x + Linear(GELU(Linear(LayerNorm(x))))``."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def region_overhead(regions: int, rounds: int, device: str) -> Row:
    x0 = torch.randn(16, 16, device=device, requires_grad=True)

    def body(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    def chain(checkpoint: Callable[..., torch.Tensor] | None) -> Callable[[], None]:
        def step() -> None:
            x = x0
            for _ in range(regions):
                x = body(x) if checkpoint is None else checkpoint(body, x)
            x.sum().backward()

        return step

    times = _interleaved(
        {
            "none": chain(None),
            "remat": chain(remat.checkpoint),
            "torch": chain(functools.partial(torch_checkpoint.checkpoint, use_reentrant=False)),
        },
        rounds,
        warmup=3,
        device=device,
    )
    return _overhead_row("per-region overhead, chain of tiny regions", times, regions, "us/region")


class Redispatch(TorchDispatchMode):
    """A dispatch mode that only runs each op: what any Python-mode SAC pays at least."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def block_chain_overhead(
    what: str, blocks: Sequence[nn.Module], x0: torch.Tensor, rounds: int, device: str, *, floor: bool = False
) -> list[Row]:
    """Per-region overhead of ``blocks`` run as a chain of regions: full and save-matmuls rows.

    With ``floor``, one more row: remat's full checkpointing with a
    :class:`Redispatch` mode in the forward and the recomputation, against
    torch's save-matmuls form. No selective checkpointing built on Python
    dispatch modes can cost less than that row's remat column.
    """
    forms = _checkpoint_forms()
    if floor and "torch sac" in forms:
        forms["remat floor"] = functools.partial(remat.checkpoint, context_fn=lambda: (Redispatch(), Redispatch()))

    def chain(checkpoint: Callable[..., torch.Tensor] | None) -> Callable[[], None]:
        def step() -> None:
            x = x0
            for block in blocks:
                x = block(x) if checkpoint is None else checkpoint(block, x)
            x.sum().backward()

        return step

    times = _interleaved({name: chain(fn) for name, fn in forms.items()}, rounds, 3, device)
    rows = []
    for kind, label in (("full", "full"), ("sac", "save matmuls")):
        pair = {"none": times["none"], "remat": times[f"remat {kind}"]}
        if f"torch {kind}" in times:
            pair["torch"] = times[f"torch {kind}"]
        rows.append(_overhead_row(f"per-region overhead, {what}, {label}", pair, len(blocks), "us/region"))
    if "remat floor" in times:
        pair = {"none": times["none"], "remat": times["remat floor"], "torch": times["torch sac"]}
        label = "floor of Python-mode SAC: full + do-nothing dispatch mode, vs torch's save matmuls"
        rows.append(_overhead_row(f"per-region overhead, {what}, {label}", pair, len(blocks), "us/region"))
        # remat's save matmuls against that floor, round by round (the torch column is the floor)
        pair = {"none": times["none"], "remat": times["remat sac"], "torch": times["remat floor"]}
        label = "save matmuls vs the floor (torch column: the floor)"
        rows.append(_overhead_row(f"per-region overhead, {what}, {label}", pair, len(blocks), "us/region"))
    return rows


def tanh_blocks(count: int, rounds: int, device: str) -> list[Row]:
    torch.manual_seed(0)
    blocks = [TanhBlock(64).to(device) for _ in range(count)]
    x0 = torch.randn(64, 64, device=device, requires_grad=True)
    return block_chain_overhead("1-parameter blocks x + 0.5 tanh(x @ W)", blocks, x0, rounds, device, floor=True)


def mlp_blocks(count: int, rounds: int, device: str) -> list[Row]:
    torch.manual_seed(0)
    blocks = [MLPBlock(64, 128).to(device) for _ in range(count)]
    x0 = torch.randn(64, 64, device=device, requires_grad=True)
    return block_chain_overhead("residual MLP blocks (6 parameters)", blocks, x0, rounds, device)


def gpt_blocks(count: int, rounds: int, device: str) -> list[Row]:
    torch.manual_seed(0)
    config = GPTConfig(seq_len=16, d_model=64, n_heads=4, d_ff=128, n_layers=count)
    blocks = [Block(config).to(device) for _ in range(count)]
    x0 = torch.randn(2, config.seq_len, config.d_model, device=device, requires_grad=True)
    return block_chain_overhead("GPT blocks (12 parameters)", blocks, x0, rounds, device)


def sac_op_overhead(ops: int, rounds: int, device: str) -> Row:
    w = torch.randn(8, 8, device=device, requires_grad=True)
    x0 = torch.randn(8, 8, device=device, requires_grad=True)

    def body(x: torch.Tensor) -> torch.Tensor:
        for _ in range(ops // 2):
            x = (x @ w).tanh()
        return x

    torch_context = _torch_sac_context()
    steps: dict[str, Callable[[], object]] = {
        "none": lambda: body(x0).sum().backward(),
        "remat": lambda: remat.checkpoint(body, x0, policy=save_matmuls).sum().backward(),
    }
    if torch_context is not None:
        steps["torch"] = lambda: torch_checkpoint.checkpoint(
            body, x0, use_reentrant=False, context_fn=torch_context
        ).sum().backward()
    times = _interleaved(steps, rounds, warmup=3, device=device)
    return _overhead_row("SAC per-op overhead (save matmuls)", times, ops, "us/op")


def _overhead_row(what: str, times: dict[str, list[float]], count: int, unit: str) -> Row:
    none = times["none"]

    def per_item(name: str) -> list[float]:
        return [(t - n) / count * 1e6 for t, n in zip(times[name], none, strict=True)]

    remat_each = per_item("remat")
    if "torch" not in times:
        return Row(what, statistics.median(remat_each), math.nan, unit, math.nan)
    torch_each = per_item("torch")
    ratios = [r / t for r, t in zip(remat_each, torch_each, strict=True) if t > 0]
    return Row(
        what,
        statistics.median(remat_each),
        statistics.median(torch_each),
        unit,
        statistics.median(ratios) if ratios else math.nan,
    )


def gpt_steps(config: GPTConfig, batch: int, rounds: int, device: str, bf16: bool) -> list[Row]:
    torch.manual_seed(0)
    model = GPT(config).to(device)
    idx, targets = make_batch(config, batch, torch.Generator().manual_seed(0))
    idx, targets = idx.to(device), targets.to(device)
    forms = _checkpoint_forms()

    @contextlib.contextmanager
    def precision() -> Iterator[None]:
        if bf16:
            with torch.autocast(device, dtype=torch.bfloat16):
                yield
        else:
            yield

    def step(checkpoint: Callable[..., torch.Tensor] | None) -> Callable[[], None]:
        def run() -> None:
            model.zero_grad(set_to_none=True)
            with precision():
                loss = lm_loss(model(idx, checkpoint_fn=checkpoint), targets)
            loss.backward()

        return run

    times = _interleaved(
        {name: step(fn) for name, fn in forms.items()}, rounds, warmup=2, device=device
    )
    none = times["none"]

    def vs_none(name: str) -> float:
        if name not in times:
            return math.nan
        return statistics.median(t / n for t, n in zip(times[name], none, strict=True))

    def vs_torch(kind: str) -> float:
        if f"torch {kind}" not in times:
            return math.nan
        return statistics.median(
            r / t for r, t in zip(times[f"remat {kind}"], times[f"torch {kind}"], strict=True)
        )

    shape = f"GPT d{config.d_model} L{config.n_layers} s{config.seq_len} b{batch}"
    shape += " bf16" if bf16 else ""
    return [
        Row(f"full checkpoint step, {shape}", vs_none("remat full"), vs_none("torch full"),
            "x none", vs_torch("full")),
        Row(f"SAC save-matmuls step, {shape}", vs_none("remat sac"), vs_none("torch sac"),
            "x none", vs_torch("sac")),
    ]


GROUPS = ("tiny", "tanh", "mlp", "gpt-blocks", "sac-op", "gpt-steps")
"""Row groups, in table order; ``--only`` picks some of them."""


def measure(quick: bool, rounds: int | None, device: str, only: Sequence[str] = GROUPS) -> list[Row]:
    rounds = rounds or (10 if device == "cuda" else 5 if quick else 15)
    chain = 2 * rounds  # a chain round is short: more of them
    scale = 4 if quick else 1
    if device == "cuda":
        full = GPTConfig(vocab_size=32000, seq_len=1024, d_model=2048, n_heads=16, n_layers=12,
                         d_ff=8192)
        sac = GPTConfig(vocab_size=32000, seq_len=1024, d_model=1024, n_heads=16, n_layers=12,
                        d_ff=4096)

        def steps() -> list[Row]:  # both forms at both sizes: SAC's step against full's
            return [*gpt_steps(full, 4, rounds, device, bf16=True),
                    *gpt_steps(sac, 8, rounds, device, bf16=True)]
    else:
        config = GPTConfig(n_layers=2 if quick else 4, d_model=64 if quick else 128,
                           seq_len=64 if quick else 128)

        def steps() -> list[Row]:
            return gpt_steps(config, 2 if quick else 4, rounds, device, bf16=False)

    groups: dict[str, Callable[[], list[Row]]] = {
        "tiny": lambda: [region_overhead(200 // scale, chain, device)],
        "tanh": lambda: tanh_blocks(200 // scale, chain, device),
        "mlp": lambda: mlp_blocks(100 // scale, chain, device),
        "gpt-blocks": lambda: gpt_blocks(24 // scale, chain, device),
        "sac-op": lambda: [sac_op_overhead(400 // scale, chain, device)],
        "gpt-steps": steps,
    }
    return [row for name in GROUPS if name in only for row in groups[name]()]


def _cell(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f}"


def render(rows: Sequence[Row]) -> str:
    lines = [
        "| what | remat | torch | unit | remat / torch |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.what} | {_cell(row.remat)} | {_cell(row.torch)} | {row.unit} | "
            f"{_cell(row.ratio)} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds (< 1 min)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per row")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--only", default=",".join(GROUPS), metavar="GROUPS",
                        help=f"comma-separated row groups among {', '.join(GROUPS)} (default: all)")
    args = parser.parse_args(argv)
    only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(only) - set(GROUPS))
    if unknown:
        parser.error(f"--only: unknown row groups {unknown}; choose among {list(GROUPS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure(args.quick, args.rounds, args.device, only)
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads; "
          "medians of per-round ratios, interleaved")
    print(render(rows))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"torch": torch.__version__, "device": device,
                       "rows": [asdict(row) for row in rows]}, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
