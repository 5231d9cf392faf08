"""Sharded memory benchmark: the one-process estimate against real multi-process runs.

For 1, 2 and 4 ranks (CPU, gloo), each case (a model, a sharding, a
checkpointing strategy, frozen parameters or not) runs for real on that many
local processes, one launch per world size: every rank takes a warm-up step
and a tracked step (``remat.memory.track``). The same case is estimated here,
in one process, on fake tensors and simulated ranks. The first table gives
the estimated and measured peak and end of forward (the largest and the
smallest over the ranks) and the error; the second, how long the estimate of
one larger model takes as the simulated world grows (medians of rounds taken
in turn).

    python benchmarks/sharded_memory.py           # both tables (a few minutes on 2 CPU cores)
    python benchmarks/sharded_memory.py --quick   # fewer cases, smaller timing model
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from remat.cli.estimate import PRESETS, ShardedCase
from remat.cli.loader import ModelRequest
from remat.launch import run_on_ranks
from remat.memory import MemoryReport, Sharding
from remat.models import GPTConfig


def llama_config(folder: Path) -> str:
    import transformers

    path = folder / "llama.json"
    transformers.LlamaConfig(
        hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
    ).to_json_file(path)
    return str(path)


def cases(folder: Path, quick: bool) -> dict[int, dict[str, ShardedCase]]:
    llama = llama_config(folder)

    def hf(strategy: str, sharding: Sharding, **adapt: Any) -> ShardedCase:
        return ShardedCase(ModelRequest(command="bench", hf_config=llama, batch=2, seq=128, **adapt), strategy, sharding)

    def gpt(strategy: str, sharding: Sharding) -> ShardedCase:
        config = GPTConfig(n_layers=4, seq_len=128, d_model=128, n_heads=4)
        return ShardedCase(ModelRequest(command="bench", gpt=config, batch=2), strategy, sharding)

    def fsdp(n: int, **options: Any) -> Sharding:
        return Sharding(world_size=n, fsdp=True, **options)

    table: dict[int, dict[str, ShardedCase]] = {}
    for n in (1, 2, 4):
        row = {
            "Llama | FSDP2 | none": hf("none", fsdp(n)),
            "Llama | FSDP2 | remat": hf("remat", fsdp(n)),
            "Llama | FSDP2 bf16 | save_matmuls": hf("remat:save_matmuls", fsdp(n, mixed_precision="bf16")),
            "Llama | FSDP2, no reshard | remat": hf("remat", fsdp(n, reshard_after_forward=False)),
            "Llama LoRA r8 | FSDP2 | remat": hf("remat", fsdp(n), lora_rank=8),
            "Llama frozen base | FSDP2 bf16 | none": hf("none", fsdp(n, mixed_precision="bf16"), freeze=("model.*",)),
            "GPT | FSDP2 bf16 | names": gpt("remat:names", fsdp(n, mixed_precision="bf16")),
        }
        if n >= 2:
            row["Llama | TP | remat"] = hf("remat", Sharding(world_size=n, tp=2) if n == 2 else fsdp(n, tp=2))
            row["GPT | TP (MLP) | save_matmuls"] = gpt("remat:save_matmuls", Sharding(world_size=2, tp=2) if n == 2 else fsdp(n, tp=2))
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
            per_rank: list[list[MemoryReport]] = run_on_ranks(
                n, "remat.cli.estimate:measure_sharded_steps", list(row.values()), timeout_s=1200
            )
            for position, (name, case) in enumerate(row.items()):
                estimate = case.estimate()
                measured = [reports[position] for reports in per_rank]
                peaks = [m.peak_bytes for m in measured]
                ends = [m.forward_end_bytes for m in measured]
                error = max(abs(estimate.peak_bytes - p) / p for p in peaks)
                errors.append(error)
                model, sharding, strategy = (part.strip() for part in name.split("|"))
                sharding = case.sharding.describe().split(": ", 1)[-1] if n > 1 else sharding
                print(
                    f"| {model} | {sharding} | {strategy} | {n} | {mib(estimate.peak_bytes)} "
                    f"| {mib(max(peaks))} / {mib(min(peaks))} | {100 * error:.3f}% "
                    f"| {mib(estimate.forward_end_bytes)} | {mib(max(ends))} / {mib(min(ends))} |"
                )
    exact = sum(1 for e in errors if e == 0)
    print(f"\npeak within 1% on {sum(1 for e in errors if e <= 0.01)}/{len(errors)} rows; "
          f"byte-exact on {exact}/{len(errors)}; worst {100 * max(errors):.3f}%")


def estimate_time(preset: str, world_sizes: tuple[int, ...], rounds: int) -> None:
    request = ModelRequest(command="bench", gpt=PRESETS[preset], batch=1, dtype=__import__("torch").bfloat16)
    times: dict[int, list[float]] = {n: [] for n in world_sizes}
    peaks: dict[int, int] = {}
    for round_ in range(rounds):
        order = world_sizes[round_ % len(world_sizes):] + world_sizes[: round_ % len(world_sizes)]
        for n in order:
            case = ShardedCase(request, "remat", Sharding(world_size=n, fsdp=True))
            start = time.perf_counter()
            peaks[n] = case.estimate().peak_bytes
            times[n].append(time.perf_counter() - start)
    print(f"\nestimate of the {preset} preset (bf16, FSDP2, remat, batch 1, seq {PRESETS[preset].seq_len}), "
          f"median of {rounds} rounds:")
    print("| simulated ranks | estimate s | peak per rank GiB |")
    print("|---|---|---|")
    for n in world_sizes:
        print(f"| {n} | {statistics.median(times[n]):.1f} | {peaks[n] / 2**30:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cases, the 1b preset timed once")
    args = parser.parse_args()
    accuracy(args.quick)
    if args.quick:
        estimate_time("tiny", (2, 64), 1)
    else:
        estimate_time("1b", (2, 8, 64), 3)


if __name__ == "__main__":
    main()
