"""Sharded memory benchmark: ``remat estimate``'s one-process estimate against real multi-process runs.

For 1, 2 and 4 ranks (CPU, gloo), each case (a model, a sharding, a
checkpointing strategy, frozen parameters or not) is run as users run it:
``python -m remat estimate ... --world-size N --fsdp ... --measure --json``.
The command estimates rank 0's step in one process, on fake tensors and
simulated ranks, then runs the step for real on N local processes (a warm-up
step and a tracked step each, ``remat.memory.track``). The first table gives
the estimated and measured peak and end of forward (the largest and the
smallest over the ranks) and the error; the second, how long the estimate of
one larger model takes as the simulated world grows (the ``elapsed_s`` the
command reports, medians of rounds taken in turn). The Llama is built from a
``LlamaConfig`` written here (nothing is downloaded).

    python benchmarks/sharded_memory.py           # both tables (several minutes on 2 CPU cores)
    python benchmarks/sharded_memory.py --quick   # fewer cases, the tiny preset timed once
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from command import run_remat  # this folder
from remat.memory import Sharding
from remat.models import PRESETS


def llama_config(folder: Path) -> str:
    import transformers

    path = folder / "llama.json"
    transformers.LlamaConfig(
        hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
    ).to_json_file(path)
    return str(path)


@dataclass(frozen=True)
class Case:
    """One row: the model's flags, the strategy and the sharding's flags of ``remat estimate``."""

    model: tuple[str, ...]
    strategy: str
    sharding: tuple[str, ...]

    def run(self, world_size: int) -> dict[str, Any]:
        """The command's JSON: the estimate and, per rank, the measured step."""
        return run_remat(
            "estimate", *self.model, "--strategy", self.strategy, "--world-size", str(world_size),
            *self.sharding, "--measure",
        )[1]


def cases(folder: Path, quick: bool) -> dict[int, dict[str, Case]]:
    llama = ("--hf-config", llama_config(folder), "--batch", "2", "--seq", "128")
    gpt = ("--layers", "4", "--seq", "128", "--d-model", "128", "--heads", "4", "--batch", "2")
    fsdp, bf16 = ("--fsdp",), ("--fsdp", "--mixed-precision", "bf16")
    table: dict[int, dict[str, Case]] = {}
    for n in (1, 2, 4):
        row = {
            "Llama | FSDP2 | none": Case(llama, "none", fsdp),
            "Llama | FSDP2 | remat": Case(llama, "remat", fsdp),
            "Llama | FSDP2 bf16 | save_matmuls": Case(llama, "remat:save_matmuls", bf16),
            "Llama | FSDP2, no reshard | remat": Case(llama, "remat", ("--fsdp", "--no-reshard")),
            "Llama LoRA r8 | FSDP2 | remat": Case((*llama, "--lora", "8"), "remat", fsdp),
            "Llama frozen base | FSDP2 bf16 | none": Case((*llama, "--freeze", "model.*"), "none", bf16),
            "GPT | FSDP2 bf16 | names": Case(gpt, "remat:names", bf16),
        }
        if n >= 2:
            tp = ("--tp", "2") if n == 2 else ("--fsdp", "--tp", "2")
            row["Llama | TP | remat"] = Case(llama, "remat", tp)
            row["GPT | TP (MLP) | save_matmuls"] = Case(gpt, "remat:save_matmuls", tp)
        if quick:
            row = dict(list(row.items())[:3])
        table[n] = row
    return table


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.3f}"


def accuracy(quick: bool) -> None:
    print("| model | sharding | strategy | N | estimated peak MiB | measured peak MiB (max / min over ranks) "
          "| error | estimated end of fwd MiB | measured end of fwd MiB (max / min) |")
    print("|---|---|---|---|---|---|---|---|---|")
    errors = []
    with tempfile.TemporaryDirectory() as folder:
        for n, row in cases(Path(folder), quick).items():
            for name, case in row.items():
                result = case.run(n)
                peaks = [rank["peak_bytes"] for rank in result["measured"]]
                ends = [rank["forward_end_bytes"] for rank in result["measured"]]
                error = max(abs(result["peak_bytes"] - p) / p for p in peaks)
                errors.append(error)
                model, sharding, strategy = (part.strip() for part in name.split("|"))
                sharding = Sharding(**result["sharding"]).describe().split(": ", 1)[-1] if n > 1 else sharding
                print(
                    f"| {model} | {sharding} | {strategy} | {n} | {mib(result['peak_bytes'])} "
                    f"| {mib(max(peaks))} / {mib(min(peaks))} | {100 * error:.3f}% "
                    f"| {mib(result['forward_end_bytes'])} | {mib(max(ends))} / {mib(min(ends))} |",
                    flush=True,
                )
    exact = sum(1 for e in errors if e == 0)
    print(f"\npeak within 1% on {sum(1 for e in errors if e <= 0.01)}/{len(errors)} rows; "
          f"byte-exact on {exact}/{len(errors)}; worst {100 * max(errors):.3f}%")


def estimate_time(preset: str, world_sizes: tuple[int, ...], rounds: int) -> None:
    times: dict[int, list[float]] = {n: [] for n in world_sizes}
    peaks: dict[int, int] = {}
    for round_ in range(rounds):
        order = world_sizes[round_ % len(world_sizes):] + world_sizes[: round_ % len(world_sizes)]
        for n in order:
            result = run_remat(
                "estimate", "--preset", preset, "--batch", "1", "--dtype", "bfloat16", "--strategy", "remat",
                "--world-size", str(n), "--fsdp",
            )[1]
            peaks[n] = result["peak_bytes"]
            times[n].append(result["elapsed_s"])
    print(f"\nestimate of the {preset} preset (bf16, FSDP2, remat, batch 1, seq {PRESETS[preset].seq_len}), "
          f"median of {rounds} rounds:")
    print("| simulated ranks | estimate s | peak per rank GiB |")
    print("|---|---|---|")
    for n in world_sizes:
        print(f"| {n} | {statistics.median(times[n]):.1f} | {peaks[n] / 2**30:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cases, the tiny preset timed once")
    args = parser.parse_args()
    accuracy(args.quick)
    if args.quick:
        estimate_time("tiny", (2, 64), 1)
    else:
        estimate_time("1b", (2, 8, 64), 3)


if __name__ == "__main__":
    main()
