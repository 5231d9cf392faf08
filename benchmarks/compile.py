"""remat vs torch.utils.checkpoint under the same torch.compile, on the embedded GPT.

For each strategy (no checkpointing, full checkpointing, save-matmuls; remat
and torch for the last two), one training step (forward, backward) is compiled
with ``torch.compile(fullgraph=True)``; the table gives the compile time (the
first step, which compiles forward and backward), the compiled step time, and
ratios. Strategies take turns step by step, the order rotating each round, so
machine-load drift hits them alike; ratios are medians of per-round ratios.
Compile caches are off so that identical graphs (remat and torch produce the
same ones) are compiled afresh for each strategy.

    .venv/bin/python benchmarks/compile.py [--layers N] [--seq N] [--batch N] [--steps N]
"""

from __future__ import annotations

import argparse
import collections
import copy
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
import torch.utils.checkpoint as tuc
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd

import remat
from remat import policies
from remat.models import GPT, GPTConfig, lm_loss, make_batch

STRATEGIES: dict[str, Callable[..., Any] | None] = {
    "none": None,
    "torch:full": functools.partial(tuc.checkpoint, use_reentrant=False),
    "remat:full": remat.checkpoint,
    "torch:save_matmuls": functools.partial(
        tuc.checkpoint,
        use_reentrant=False,
        context_fn=functools.partial(
            tuc.create_selective_checkpoint_contexts, sorted(policies.MATMUL_OPS, key=str)
        ),
    ),
    "remat:save_matmuls": functools.partial(remat.checkpoint, policy=policies.save_matmuls),
}
"""Name -> ``checkpoint_fn`` for ``GPT.forward`` (None: no checkpointing)."""


@dataclass(frozen=True)
class Result:
    strategy: str
    compile_s: float
    median_step_s: float
    vs_none: float
    vs_torch: float | None
    same_graphs_as_torch: bool | None
    max_grad_abs_diff: float


def _step(
    model: GPT, forward: Callable[[torch.Tensor], torch.Tensor], idx: torch.Tensor, targets: torch.Tensor
) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    lm_loss(forward(idx), targets).backward()
    return time.perf_counter() - start


def _grad_diff(model: GPT, reference: GPT) -> float:
    return max(
        float((p.grad - q.grad).abs().max())  # type: ignore[operator]
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )


def _compiled(
    config: GPTConfig, backend: str
) -> tuple[dict[str, GPT], dict[str, Callable[[torch.Tensor], torch.Tensor]]]:
    torch.manual_seed(0)
    base = GPT(config)
    models = {name: copy.deepcopy(base) for name in STRATEGIES}
    forwards = {
        name: torch.compile(
            functools.partial(models[name], checkpoint_fn=fn), backend=backend, fullgraph=True
        )
        for name, fn in STRATEGIES.items()
    }
    return models, forwards


def compile_seconds(name: str, args: argparse.Namespace) -> float:
    """First-step time of one strategy in a fresh process with an empty inductor cache."""
    with tempfile.TemporaryDirectory() as cache:
        command = [
            sys.executable, __file__, "--layers", str(args.layers), "--seq", str(args.seq),
            "--batch", str(args.batch), "--backend", args.backend, "--compile-only", name,
        ]
        done = subprocess.run(
            command, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache},
            capture_output=True, text=True, check=True,
        )
    return float(done.stdout.split()[-1])


def _graph_ops(name: str, config: GPTConfig, batch: int) -> list[collections.Counter[Any]]:
    """Op counts of the forward and backward graphs AOTAutograd hands to the compiler."""
    graphs: list[collections.Counter[Any]] = []

    def record(gm: torch.fx.GraphModule, _inputs: Any) -> Any:
        graphs.append(collections.Counter(str(n.target) for n in gm.graph.nodes))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(
        fw_compiler=record, bw_compiler=record, partition_fn=min_cut_rematerialization_partition
    )
    torch.manual_seed(0)
    model = GPT(config)
    forward = torch.compile(
        functools.partial(model, checkpoint_fn=STRATEGIES[name]), backend=backend, fullgraph=True
    )
    idx, targets = make_batch(config, batch, torch.Generator().manual_seed(0))
    _step(model, forward, idx, targets)
    return graphs


def _first_step(name: str, config: GPTConfig, batch: int, backend: str) -> float:
    models, forwards = _compiled(config, backend)
    idx, targets = make_batch(config, batch, torch.Generator().manual_seed(0))
    return _step(models[name], forwards[name], idx, targets)


def same_graphs(config: GPTConfig, batch: int) -> dict[str, bool]:
    """For each remat strategy: whether torch's counterpart gives the same graphs."""
    found = {}
    for name in STRATEGIES:
        if name.startswith("remat:"):
            ours = _graph_ops(name, config, batch)
            torch.compiler.reset()
            found[name] = ours == _graph_ops("torch:" + name[6:], config, batch)
            torch.compiler.reset()
    return found


def run(
    config: GPTConfig,
    batch: int,
    steps: int,
    backend: str,
    compile_s: dict[str, float],
    graphs_match: dict[str, bool],
) -> list[Result]:
    models, forwards = _compiled(config, backend)
    batches = torch.Generator().manual_seed(0)
    idx, targets = make_batch(config, batch, batches)
    for name in STRATEGIES:  # compile (timed apart, in fresh processes)
        _step(models[name], forwards[name], idx, targets)
    names = list(STRATEGIES)
    times: dict[str, list[float]] = {name: [] for name in names}
    ratios: dict[str, list[float]] = {name: [] for name in names}
    torch_ratios: dict[str, list[float]] = {name: [] for name in names}
    diffs = dict.fromkeys(names, 0.0)
    for round_ in range(steps):
        idx, targets = make_batch(config, batch, batches)
        shift = round_ % len(names)
        this_round = {}
        for name in names[shift:] + names[:shift]:
            this_round[name] = _step(models[name], forwards[name], idx, targets)
        for name in names:
            times[name].append(this_round[name])
            ratios[name].append(this_round[name] / this_round["none"])
            if name.startswith("remat:"):
                torch_ratios[name].append(this_round[name] / this_round["torch:" + name[6:]])
            diffs[name] = max(diffs[name], _grad_diff(models[name], models["none"]))
    return [
        Result(
            strategy=name,
            compile_s=compile_s[name],
            median_step_s=statistics.median(times[name]),
            vs_none=statistics.median(ratios[name]),
            vs_torch=statistics.median(torch_ratios[name]) if torch_ratios[name] else None,
            same_graphs_as_torch=graphs_match.get(name),
            max_grad_abs_diff=diffs[name],
        )
        for name in names
    ]


def render(results: Sequence[Result]) -> str:
    header = (
        "strategy", "compile (s)", "step (ms)", "vs none", "vs torch", "same graphs", "max |grad - none|"
    )
    rows = [
        (
            r.strategy,
            f"{r.compile_s:.1f}",
            f"{r.median_step_s * 1e3:.1f}",
            f"{r.vs_none:.2f}x",
            "" if r.vs_torch is None else f"{r.vs_torch:.2f}x",
            {None: "", True: "yes", False: "NO"}[r.same_graphs_as_torch],
            f"{r.max_grad_abs_diff:.1e}",
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join([row[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True))])
        for row in [header, *rows]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="measured rounds")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--compile-only", choices=list(STRATEGIES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # No graph caches: each strategy's graphs are compiled, never fetched.
    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    config = GPTConfig(n_layers=args.layers, seq_len=args.seq)
    if args.compile_only is not None:
        print(_first_step(args.compile_only, config, args.batch, args.backend))
        return 0
    compile_s = {name: compile_seconds(name, args) for name in STRATEGIES}
    graphs = same_graphs(config, args.batch)
    results = run(config, args.batch, args.steps, args.backend, compile_s, graphs)
    print(
        f"GPT {args.layers} layers, d_model {config.d_model}, batch {args.batch} x seq {args.seq}; "
        f"torch.compile(backend={args.backend!r}, fullgraph=True); torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; medians over {args.steps} interleaved rounds"
    )
    print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
