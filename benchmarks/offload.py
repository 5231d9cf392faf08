"""Offload on the embedded GPT: remat's forms against torch's, with the fraction of copy time hidden.

Forms (all on one copy of the weights, bf16 autocast on CUDA):

* ``none``: no checkpointing, no offload (reference);
* ``checkpoint``: every block under ``remat.checkpoint_wrapper``;
* ``torch save_on_cpu``: the whole forward under ``torch.autograd.graph.save_on_cpu(pin_memory=True)``;
* ``torch offload_wrapper``: every block in torch's ``offload_wrapper``;
* ``torch offload+ckpt``: torch's ``offload_wrapper(checkpoint_wrapper(block))``;
* ``remat offload``: the whole forward under ``remat.offload()``;
* ``remat offload_wrapper``: every block in ``remat.offload_wrapper``;
* ``remat offload+ckpt``: ``remat.offload_wrapper(remat.checkpoint_wrapper(block))``;
* ``remat policy offload``: every block checkpointed with a policy that
  offloads the matmul outputs and saves nothing else.

Columns: step time (median) and its ratio to ``none``; peak and end-of-forward
device bytes; bytes copied to the host in one step; the copy time those bytes
take alone (measured with pinned buffers on this GPU, both directions); and
the fraction of that copy time hidden behind compute:
``1 - (step - reference step) / copy time alone``, where the reference is
``none`` for forms without checkpointing and ``checkpoint`` for the pairings.
1.0 means the copies cost nothing; 0.0 means they were fully exposed. ``grad err``:
the largest relative gradient difference to ``none`` over the parameters
(max |g - g_none| / max |g_none|, per parameter); 0 on CPU.

End-of-forward bytes are read after a device synchronize and one small
allocation: memory whose last reader was a side-stream copy is returned to the
caching allocator on its next allocation (``record_stream`` semantics).

On CPU the model is tiny, the copies are ordinary memory copies, and overlap
is not measurable: the hidden fraction is not printed.

    .venv/bin/python benchmarks/offload.py [--device cpu|cuda] [--rounds N] [--warmup N]
                                           [--batch N] [--layers N] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as torch_wrapper
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import remat
import remat.policies as P
from remat.memory import track
from remat.models import GPT, GPTConfig, lm_loss, make_batch
from remat.offload import HostTransfer

Forward = Callable[[], torch.Tensor]

FORMS = (
    "none",
    "checkpoint",
    "torch save_on_cpu",
    "torch offload_wrapper",
    "torch offload+ckpt",
    "remat offload",
    "remat offload_wrapper",
    "remat offload+ckpt",
    "remat policy offload",
)
REFERENCE = {
    "torch offload+ckpt": "checkpoint",
    "remat offload+ckpt": "checkpoint",
    "remat policy offload": "checkpoint",
}

_MATMULS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default})


def offload_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> P.CheckpointPolicy:
    """Matmul outputs go to the host; the rest is recomputed."""
    return P.CheckpointPolicy.MUST_OFFLOAD if op in _MATMULS else P.CheckpointPolicy.PREFER_RECOMPUTE


def _logits(model: GPT, blocks: Sequence[nn.Module], idx: torch.Tensor) -> torch.Tensor:
    """``model(idx)`` with its blocks replaced by ``blocks`` (wrappers of the same modules)."""
    positions = torch.arange(idx.shape[1], device=idx.device)
    h = model.drop(model.tok_emb(idx) + model.pos_emb(positions))
    for block in blocks:
        h = block(h)
    logits: torch.Tensor = model.head(model.ln_f(h))
    return logits


def build(name: str, model: GPT, idx: torch.Tensor) -> Forward:
    """The forward of form ``name``; every form shares ``model``'s weights (one copy on the device)."""
    outer: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    wrap: Callable[[nn.Module], nn.Module] = lambda block: block  # noqa: E731
    if name == "checkpoint":
        wrap = remat.checkpoint_wrapper
    elif name == "torch save_on_cpu":
        outer = lambda: torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())  # noqa: E731
    elif name == "torch offload_wrapper":
        wrap = torch_wrapper.offload_wrapper
    elif name == "torch offload+ckpt":
        wrap = lambda b: torch_wrapper.offload_wrapper(torch_wrapper.checkpoint_wrapper(b))  # noqa: E731
    elif name == "remat offload":
        outer = remat.offload
    elif name == "remat offload_wrapper":
        wrap = remat.offload_wrapper
    elif name == "remat offload+ckpt":
        wrap = lambda b: remat.offload_wrapper(remat.checkpoint_wrapper(b))  # noqa: E731
    elif name == "remat policy offload":
        wrap = lambda b: remat.checkpoint_wrapper(b, policy=offload_matmuls)  # noqa: E731
    blocks = [wrap(block) for block in model.blocks]
    autocast = (
        (lambda: torch.autocast("cuda", dtype=torch.bfloat16))
        if idx.is_cuda
        else contextlib.nullcontext
    )

    def forward() -> torch.Tensor:
        with autocast(), outer():
            return _logits(model, blocks, idx)

    return forward


class _CountHostCopies(TorchDispatchMode):
    """Bytes that torch's forms copy from the device to the host (``copy_`` into a CPU tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.copy_.default and args[0].device.type == "cpu" and args[1].device.type != "cpu":
            self.bytes += args[1].numel() * args[1].element_size()
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _count_remat_copies() -> Iterator[list[HostTransfer]]:
    """Every HostTransfer made inside (remat's copies are invisible to dispatch modes by design)."""
    made: list[HostTransfer] = []
    original = HostTransfer.__init__

    def init(self: HostTransfer, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        made.append(self)

    HostTransfer.__init__ = init  # type: ignore[method-assign]
    try:
        yield made
    finally:
        HostTransfer.__init__ = original  # type: ignore[method-assign]


def copied_bytes(model: GPT, forward: Forward, targets: torch.Tensor) -> int:
    """Bytes one step copies to the host (torch's forms: device-to-host copies, so none on CPU)."""
    counter = _CountHostCopies()
    model.zero_grad(set_to_none=True)
    with _count_remat_copies() as transfers:
        with counter:
            loss = lm_loss(forward(), targets)
        loss.backward()
    return counter.bytes + sum(t.copied_bytes for t in transfers)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory(model: GPT, forward: Forward, targets: torch.Tensor, device: torch.device) -> tuple[int, int]:
    """(peak bytes, end-of-forward bytes) of one step, beyond what lived before it."""
    model.zero_grad(set_to_none=True)
    if device.type != "cuda":
        with track() as tracker:
            logits = forward()
            tracker.mark("forward_end")
            lm_loss(logits, targets).backward()
            del logits
        return tracker.peak_bytes, tracker.marks["forward_end"]
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    logits = forward()
    _sync(device)
    torch.empty(1, device=device)  # lets the allocator take back blocks freed behind side-stream copies
    end = torch.cuda.memory_allocated(device) - before
    lm_loss(logits, targets).backward()
    del logits
    _sync(device)
    return torch.cuda.max_memory_allocated(device) - before, end


def copy_seconds_alone(nbytes: int, device: torch.device) -> float:
    """Time to copy ``nbytes`` to pinned host memory and back, nothing else running."""
    if nbytes == 0 or device.type != "cuda":
        return 0.0
    chunk = min(nbytes, 256 << 20)
    source = torch.empty(chunk, dtype=torch.uint8, device=device)
    host = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
    for _ in range(2):
        host.copy_(source, non_blocking=True)
        source.copy_(host, non_blocking=True)
    _sync(device)
    start = time.perf_counter()
    repeats = 5
    for _ in range(repeats):
        host.copy_(source, non_blocking=True)
        source.copy_(host, non_blocking=True)
    _sync(device)
    return (time.perf_counter() - start) / repeats * nbytes / chunk


@dataclass(frozen=True)
class Row:
    form: str
    step_s: float
    ratio: float
    peak_bytes: int
    forward_end_bytes: int
    copied_bytes: int
    copy_alone_s: float
    hidden_fraction: float | None
    grad_error: float


def measure(config: GPTConfig, batch: int, rounds: int, warmup: int, device: torch.device) -> list[Row]:
    torch.manual_seed(0)
    model = GPT(config).to(device)
    idx, targets = (t.to(device) for t in make_batch(config, batch, torch.Generator().manual_seed(0)))
    built = {name: build(name, model, idx) for name in FORMS}
    stats = {}
    errors: dict[str, float] = {}
    reference: list[torch.Tensor] = []
    for name, forward in built.items():
        nbytes = copied_bytes(model, forward, targets)  # also leaves this form's gradients
        grads = [p.grad.detach().float().clone() for p in model.parameters() if p.grad is not None]
        reference = reference or grads
        errors[name] = max(
            ((g - r).abs().max() / r.abs().max().clamp_min(1e-30)).item() for g, r in zip(grads, reference, strict=True)
        )
        stats[name] = (*memory(model, forward, targets, device), nbytes)
    times: dict[str, list[float]] = {name: [] for name in FORMS}
    for round_ in range(warmup + rounds):
        for name, forward in built.items():  # interleaved: drift hits every form alike
            model.zero_grad(set_to_none=True)
            _sync(device)
            start = time.perf_counter()
            lm_loss(forward(), targets).backward()
            _sync(device)
            if round_ >= warmup:
                times[name].append(time.perf_counter() - start)
    step = {name: statistics.median(values) for name, values in times.items()}
    rows = []
    for name in FORMS:
        peak, end, nbytes = stats[name]
        alone = copy_seconds_alone(nbytes, device)
        hidden = None
        if device.type == "cuda" and alone > 0:
            hidden = 1.0 - (step[name] - step[REFERENCE.get(name, "none")]) / alone
        rows.append(Row(name, step[name], step[name] / step["none"], peak, end, nbytes, alone, hidden, errors[name]))
    return rows


def render(rows: list[Row]) -> str:
    header = (
        f"{'form':<23}{'step ms':>9}{'vs none':>9}{'peak MiB':>10}{'fwd-end MiB':>12}"
        f"{'copied MiB':>11}{'copy ms':>9}{'hidden':>8}{'grad err':>10}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        hidden = "n/a" if row.hidden_fraction is None else f"{row.hidden_fraction:.2f}"
        lines.append(
            f"{row.form:<23}{row.step_s * 1e3:>9.1f}{row.ratio:>9.2f}{row.peak_bytes / 2**20:>10.1f}"
            f"{row.forward_end_bytes / 2**20:>12.1f}{row.copied_bytes / 2**20:>11.1f}"
            f"{row.copy_alone_s * 1e3:>9.1f}{hidden:>8}{row.grad_error:>10.1e}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the model runs (default: cuda when available)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per batch (cuda 8, cpu 2)")
    parser.add_argument("--layers", type=int, default=None, help="transformer blocks (cuda 12, cpu 2)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    batch = args.batch or (8 if cuda else 2)
    layers = args.layers or (12 if cuda else 2)
    if cuda:
        config = GPTConfig(vocab_size=32000, seq_len=2048, d_model=2048, n_heads=16, n_layers=layers, d_ff=8192)
    else:
        config = GPTConfig(seq_len=64, d_model=64, n_heads=4, n_layers=layers, d_ff=256)
    device = torch.device(args.device)
    rows = measure(config, batch, args.rounds, args.warmup, device)
    where = torch.cuda.get_device_name(device) + ", bf16 autocast" if cuda else "CPU, float32"
    title = (
        f"GPT d_model={config.d_model} layers={config.n_layers} seq={config.seq_len} batch={batch} on {where}; "
        f"{args.rounds} rounds (+{args.warmup} warm-up), torch {torch.__version__}"
    )
    print(title)
    print(render(rows))
    if not cuda:
        print(
            "CPU run: the model is tiny and the 'host' copies are plain memory copies, so the "
            "overlap of copies with compute is not measurable here; run on a CUDA device for the "
            "hidden-copy fraction."
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"title": title, "device": where, "torch": torch.__version__,
                       "rows": [asdict(row) for row in rows]}, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
