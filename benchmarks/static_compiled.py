"""Static compiled estimates against the measured truth: `remat estimate --compile` without running.

    python benchmarks/static_compiled.py             # 5 models x fp32/bf16 x every option, then FSDP2 at 2 and 4 ranks
    python benchmarks/static_compiled.py --quick     # 2 models, fp32, 4 options, no ranks (the CI smoke test)
    python benchmarks/static_compiled.py --json out.json

For every row, one training step (forward, backward, AdamW) with every block
compiled (fullgraph, inductor) is estimated statically on fake tensors
(:func:`remat.memory.statically_compiled`: the partitioner's saved tensors,
a model of inductor's buffers, no kernel run) and then run for real and
measured with the allocator's count (:func:`remat.memory.measure_training_step`;
per rank for the sharded rows, on gloo processes). The error is
estimated / measured - 1 of the step's peak and of the end of the forward.

Models: the embedded GPT and four HuggingFace causal LMs from local configs
(nothing downloaded): Llama (grouped-query attention, rotary, RMSNorm, SwiGLU),
GPT-2 (learned positions, LayerNorm, GELU MLP, Conv1D), GPT-NeoX (parallel
attention and MLP, partial rotary) and Gemma (GeGLU, scaled embeddings, tied
head). Needs transformers for the HF rows (``pip install remat[hf]``) and torch
2.13+ for the ``budget:<f>`` rows (and 2.11+ for the sharded rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from remat._compat import fake_tensor_mode, region_memory_budgets_available
from remat.cli.estimate import ShardedCase
from remat.cli.loader import ModelRequest, load_model
from remat.cli.strategies import apply_strategy
from remat.launch import run_on_ranks
from remat.memory import Sharding, measure_training_step, statically_compiled, track_training_step
from remat.models import GPTConfig
from remat.placement import CompileSpec
from remat.planner.step import default_loss

HF_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama", "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
        "max_position_embeddings": 256,
    },
    "gpt2": {
        "model_type": "gpt2", "n_embd": 128, "n_layer": 3, "n_head": 4, "vocab_size": 512,
        "n_positions": 256, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
    },
    "gpt_neox": {
        "model_type": "gpt_neox", "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 3,
        "num_attention_heads": 4, "vocab_size": 512, "max_position_embeddings": 256,
        "rotary_pct": 0.25, "use_parallel_residual": True,
    },
    "gemma": {
        "model_type": "gemma", "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 512,
        "max_position_embeddings": 256,
    },
}
GPT = GPTConfig(n_layers=3, d_model=128, n_heads=4, d_ff=512, vocab_size=512, seq_len=128)
STRATEGIES = ("none", "remat", "torch", "remat:save_matmuls", "remat:save_matmuls_no_batch")
BUDGETS = ("budget:0.2", "budget:0.5", "budget:0.8")


@dataclasses.dataclass(frozen=True)
class Row:
    model: str
    dtype: str
    strategy: str
    ranks: int
    measured_peak: int
    static_peak: int
    measured_forward_end: int
    static_forward_end: int
    static_s: float

    @property
    def error(self) -> float:
        return self.static_peak / self.measured_peak - 1

    @property
    def forward_end_error(self) -> float:
        return self.static_forward_end / self.measured_forward_end - 1


def requests(names: list[str], folder: Path, batch: int, seq: int) -> dict[str, ModelRequest]:
    found: dict[str, ModelRequest] = {}
    for name in names:
        if name == "gpt":
            found[name] = ModelRequest(command="benchmark", gpt=dataclasses.replace(GPT, seq_len=seq), batch=batch)
            continue
        path = folder / f"{name}.json"
        path.write_text(json.dumps(HF_CONFIGS[name]))
        found[name] = ModelRequest(command="benchmark", hf_config=path, batch=batch, seq=seq)
    return found


def one_process(request: ModelRequest, strategy: str) -> tuple[int, int, int, int, float]:
    """(measured peak, static peak, measured end of forward, static end of forward, static seconds)."""
    start = time.perf_counter()
    with fake_tensor_mode():
        loaded = load_model(dataclasses.replace(request, device="fake"))
    apply_strategy(loaded, strategy, "benchmark", compile=CompileSpec())
    model, loss = loaded.model, loaded.loss_fn or default_loss
    with statically_compiled(model):
        static = track_training_step(model, lambda: loss(model(*loaded.args, **loaded.kwargs)))
    static_s = time.perf_counter() - start
    real = load_model(dataclasses.replace(request, device="cpu"))
    apply_strategy(real, strategy, "benchmark", compile=CompileSpec())
    real_loss = real.loss_fn or default_loss
    measured = measure_training_step(real.model, lambda: real_loss(real.model(*real.args, **real.kwargs)))
    torch.compiler.reset()
    return measured.peak_bytes, static.peak_bytes, measured.forward_end_bytes, static.forward_end_bytes, static_s


def sharded(request: ModelRequest, strategy: str, world_size: int) -> tuple[int, int, int, int, float]:
    case = ShardedCase(request, strategy, Sharding(world_size=world_size, fsdp=True), compile=True)
    start = time.perf_counter()
    static = case.estimate()
    static_s = time.perf_counter() - start
    torch.compiler.reset()
    per_rank = run_on_ranks(world_size, "remat.cli.estimate:measure_compiled_sharded_steps", [case], timeout_s=900)
    worst = max((steps[0] for steps in per_rank), key=lambda step: step.peak_bytes)
    return worst.peak_bytes, static.peak_bytes, worst.forward_end_bytes, static.forward_end_bytes, static_s


def render(rows: list[Row]) -> str:
    lines = [
        f"{'model':9} {'dtype':9} {'ranks':>5} {'strategy':28} {'measured peak':>14} {'static':>14} "
        f"{'error':>7} {'fwd-end error':>13} {'static s':>8}"
    ]
    for r in rows:
        lines.append(
            f"{r.model:9} {r.dtype:9} {r.ranks:>5} {r.strategy:28} {r.measured_peak:>14,} {r.static_peak:>14,} "
            f"{100 * r.error:>+6.2f}% {100 * r.forward_end_error:>+12.2f}% {r.static_s:>8.1f}"
        )
    lines.append("")
    lines.append(f"{'model':9} {'rows':>4} {'median |error|':>15} {'worst error':>12} {'worst fwd-end':>14}")
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model]
        worst = max(mine, key=lambda r: abs(r.error))
        worst_fwd = max(mine, key=lambda r: abs(r.forward_end_error))
        lines.append(
            f"{model:9} {len(mine):>4} {100 * statistics.median(abs(r.error) for r in mine):>14.2f}% "
            f"{100 * worst.error:>+11.2f}% {100 * worst_fwd.forward_end_error:>+13.2f}%"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="2 models, fp32, 4 options, no ranks")
    parser.add_argument("--models", nargs="*", default=None, help="gpt llama gpt2 gpt_neox gemma")
    parser.add_argument("--ranks", nargs="*", type=int, default=None, help="FSDP2 world sizes (default 2 4)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    hf = _transformers_available()
    names = args.models or (["gpt", "llama"] if args.quick else ["gpt", "llama", "gpt2", "gpt_neox", "gemma"])
    if not hf:
        print("# HF rows skipped (transformers is not installed: pip install remat[hf])")
        names = [n for n in names if n == "gpt"]
    dtypes = (torch.float32,) if args.quick else (torch.float32, torch.bfloat16)
    strategies = list(STRATEGIES[:3] + STRATEGIES[3:4]) if args.quick else list(STRATEGIES)
    if region_memory_budgets_available():
        strategies += list(BUDGETS[1:2] if args.quick else BUDGETS)
    ranks = [] if args.quick else (args.ranks if args.ranks is not None else [2, 4])
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as folder:
        found = requests(names, Path(folder), batch=4, seq=64 if args.quick else 128)
        for name, request in found.items():
            for dtype in dtypes:
                typed = dataclasses.replace(request, dtype=dtype)
                for strategy in strategies + (["remat:names"] if name == "gpt" else []):
                    figures = one_process(typed, strategy)
                    rows.append(Row(name, str(dtype)[6:], strategy, 1, *figures))
                    print(render(rows[-1:]).splitlines()[1], flush=True)
        for world_size in ranks:
            for name, request in found.items():
                for strategy in ("none", "remat", "remat:save_matmuls"):
                    typed = dataclasses.replace(request, dtype=torch.bfloat16)
                    figures = sharded(typed, strategy, world_size)
                    rows.append(Row(name, "bfloat16", strategy, world_size, *figures))
                    print(render(rows[-1:]).splitlines()[1], flush=True)
    print()
    print(render(rows))
    if args.json is not None:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=2) + "\n")
    return 0


def _transformers_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
