"""Estimated against measured device memory of a training step: the embedded GPT and a HF Llama.

For each model, ``remat estimate``'s peak (one steady-state training step,
forward, backward and AdamW, tracked on meta tensors; the command run as
users run it, ``python -m remat estimate ... --json``) against the same step
run for real. On CUDA the measured peaks are
``torch.cuda.max_memory_allocated`` and ``torch.cuda.max_memory_reserved``
over the step (targets: within 2% and 10% of the estimate); on the CPU, a dry
run of the pipeline, the real step's peak of live tensor bytes
(``remat.memory.track``). The Llama is built from a ``LlamaConfig`` written
here (nothing is downloaded); the GPT is ``remat.models.GPT``.

    .venv/bin/python benchmarks/memory_check.py [--device cpu|cuda] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from command import run_remat  # this folder
from remat.memory import track
from remat.models import GPT, GPTConfig, lm_loss, make_batch

ALLOCATED_TOLERANCE = 0.02
RESERVED_TOLERANCE = 0.10


@dataclass(frozen=True)
class Row:
    model: str
    estimated_bytes: int
    measured_bytes: int  # CUDA: max_memory_allocated; CPU: tracked live tensor bytes
    reserved_bytes: int | None  # CUDA only
    allocated_error: float  # measured / estimated - 1
    reserved_error: float | None

    @property
    def within_targets(self) -> bool:
        reserved_ok = self.reserved_error is None or abs(self.reserved_error) <= RESERVED_TOLERANCE
        return abs(self.allocated_error) <= ALLOCATED_TOLERANCE and reserved_ok


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), foreach=False)  # as the estimate's optimizer


def measured_peak(model: torch.nn.Module, loss: Callable[[], torch.Tensor], device: str) -> tuple[int, int | None]:
    """(peak bytes, peak reserved bytes or None) of one steady-state step: loss, backward, AdamW."""
    optimizer = _adamw(model)

    def step(tracker: Any = None) -> None:
        value = loss()
        value.backward()
        del value
        optimizer.step()
        model.zero_grad(set_to_none=True)

    step()  # creates the optimizer state: measure the steady state, as the estimate does
    if device != "cuda":
        with track(model, optimizer=optimizer) as tracker:
            step(tracker)
        return tracker.report().peak_bytes, None
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def _row(name: str, estimated: int, measured: tuple[int, int | None]) -> Row:
    allocated, reserved = measured
    return Row(
        model=name,
        estimated_bytes=estimated,
        measured_bytes=allocated,
        reserved_bytes=reserved,
        allocated_error=allocated / estimated - 1.0,
        reserved_error=None if reserved is None else reserved / estimated - 1.0,
    )


def estimated_peak(*flags: str) -> int:
    """The peak bytes ``remat estimate`` reports for one AdamW step of the model the flags name."""
    return int(run_remat("estimate", *flags, "--optimizer", "adamw")[1]["peak_bytes"])


def gpt_row(config: GPTConfig, batch: int, dtype: torch.dtype, device: str) -> Row:
    estimated = estimated_peak(
        "--layers", str(config.n_layers), "--d-model", str(config.d_model), "--heads", str(config.n_heads),
        "--d-ff", str(config.d_ff), "--vocab", str(config.vocab_size), "--seq", str(config.seq_len),
        "--batch", str(batch), "--dtype", str(dtype)[6:],
    )
    torch.manual_seed(0)
    model = GPT(config).to(device=device, dtype=dtype)
    idx, targets = (t.to(device) for t in make_batch(config, batch, torch.Generator().manual_seed(0)))
    measured = measured_peak(model, lambda: lm_loss(model(idx), targets), device)
    name = f"GPT d{config.d_model} L{config.n_layers} seq {config.seq_len} batch {batch} {str(dtype)[6:]}"
    return _row(name, estimated, measured)


def llama_config(quick: bool) -> dict[str, Any]:
    """A small Llama, written as a local config.json (nothing downloaded)."""
    from transformers import LlamaConfig

    if quick:
        config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    else:
        config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
                             num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=1024)
    return config.to_dict()  # type: ignore[no-any-return]


def llama_row(config: dict[str, Any], batch: int, seq: int, dtype: torch.dtype, device: str) -> Row:
    import transformers

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(config))
        estimated = estimated_peak(
            "--hf-config", str(path), "--seq", str(seq), "--batch", str(batch), "--dtype", str(dtype)[6:]
        )
    # As the command builds it, with data: random weights, no KV cache, random tokens.
    hf_config = transformers.LlamaConfig.from_dict({**config, "use_cache": False})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).train().to(device=device, dtype=dtype)
    ids = torch.randint(config["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    targets = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    measured = measured_peak(model, lambda: lm_loss(model(ids).logits, targets), device)
    name = (f"HF Llama h{config['hidden_size']} L{config['num_hidden_layers']} seq {seq} batch {batch} "
            f"{str(dtype)[6:]}")
    return _row(name, estimated, measured)


def measure(device: str, quick: bool) -> list[Row]:
    if device == "cuda" and not quick:
        dtype = torch.bfloat16
        gpt = GPTConfig(vocab_size=32000, seq_len=1024, d_model=1024, n_heads=16, n_layers=8, d_ff=4096)
        return [gpt_row(gpt, 4, dtype, device), llama_row(llama_config(False), 4, 1024, dtype, device)]
    gpt = GPTConfig(seq_len=64, d_model=64, n_heads=4, n_layers=2, d_ff=256)
    return [gpt_row(gpt, 2, torch.float32, device), llama_row(llama_config(True), 2, 32, torch.float32, device)]


def _mib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**20:.1f}"


def _percent(error: float | None) -> str:
    return "n/a" if error is None else f"{100 * error:+.2f}%"


def render(rows: Sequence[Row], device: str) -> str:
    measured = "max allocated MiB" if device == "cuda" else "measured peak MiB (tracked)"
    lines = [
        f"| model | estimated MiB | {measured} | error | max reserved MiB | error | within 2% / 10% |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.model} | {_mib(row.estimated_bytes)} | {_mib(row.measured_bytes)} | "
            f"{_percent(row.allocated_error)} | {_mib(row.reserved_bytes)} | {_percent(row.reserved_error)} | "
            f"{'yes' if row.within_targets else 'no'} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny models (the CPU sizes)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    rows = measure(args.device, args.quick)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"estimated (meta tensors) against measured peak, one AdamW training step, {where}, "
          f"torch {torch.__version__}")
    print(render(rows, args.device))
    if args.json:
        with open(args.json, "w") as out:
            payload = [{**asdict(row), "within_targets": row.within_targets} for row in rows]
            json.dump({"device": where, "torch": torch.__version__, "rows": payload}, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
