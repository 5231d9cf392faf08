"""A training step's time from the work of its ops, for models that cannot run here.

Layer: ``remat.planner``, beside ``phases`` (the profiler reads a step's
windows off :class:`ModelledClock` instead of the wall clock); imports
``remat._compat``, ``remat.errors``, ``remat._engine.selective`` and
``remat.policies`` (to measure a policy mode's cost) and torch's public
``flop_counter`` formulas.

The planner times its options by running them. A model too large for the
machine runs on fake tensors instead (nothing is computed), and its time is
*modelled*: every op, and every kernel of a compiled graph, costs

    ``max(FLOPs / matmul rate, bytes moved / memory bandwidth) + launch overhead``

(the roofline with a fixed cost per kernel), plus, for every op a selective
policy's dispatch mode handles (in a selective region's forward and
recomputation, where a replayed op costs only this), that mode's Python cost
(:attr:`DeviceRates.policy_op_overhead_s`), at a device's rates
(:class:`DeviceRates`): measured here with :meth:`DeviceRates.measure`, or a
named accelerator's datasheet figures with :meth:`DeviceRates.named`. FLOPs
are torch's own formulas (``torch.utils.flop_counter``: matmuls, attention,
convolutions); the bytes of a compiled graph are those of inductor's buffers
as :class:`remat.memory.BufferPlan` models them (a fused kernel reads the
buffers it fuses from and writes its own). Collectives are not timed: FSDP2
overlaps them with compute. Why a model is good enough to choose a plan, and
what it gets wrong: ``docs/design/planner.md``, "Estimated plans".

Example:
    >>> import torch
    >>> from remat.planner.timing import DeviceRates, ModelledClock
    >>> rates = DeviceRates.named("h100")
    >>> with ModelledClock(rates) as clock:
    ...     _ = torch.randn(4096, 4096) @ torch.randn(4096, 4096)
    >>> round(clock.seconds() * 1e3, 2)   # 137 GFLOP at 66.9 TFLOP/s (fp32), two randn
    2.12
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils import flop_counter

from remat._compat.dispatch import DEVICE_QUERY, TorchDispatchMode
from remat._compat.pytree import tree_flatten
from remat._engine.selective import SelectiveContexts
from remat.errors import CheckpointUsageError
from remat.policies import save_matmuls

__all__ = ["DEVICES", "DeviceRates", "ModelledClock", "graph_seconds"]


@dataclass(frozen=True)
class DeviceRates:
    """What a device does per second, for :class:`ModelledClock`.

    Attributes:
        name: the device ("h100", or "cpu (measured)").
        matmul_flops_per_s: dense matmul throughput per dtype; a dtype not
            listed uses ``float32``'s.
        memory_bytes_per_s: memory bandwidth.
        op_overhead_s: fixed cost of one eager op (dispatch and launch).
        kernel_overhead_s: fixed cost of one compiled kernel.
        measured: measured on this machine, not taken from a datasheet.
        policy_op_overhead_s: what a selective policy's dispatch mode adds to
            each op it handles (a Python call per op, on the host, whatever the
            device); 0 models none.
    """

    name: str
    matmul_flops_per_s: Mapping[torch.dtype, float] = field(hash=False)
    memory_bytes_per_s: float
    op_overhead_s: float
    kernel_overhead_s: float
    measured: bool = False
    policy_op_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if torch.float32 not in self.matmul_flops_per_s:
            raise CheckpointUsageError(
                f"remat.planner: DeviceRates({self.name!r}) needs a float32 matmul rate (the "
                "fallback for dtypes it does not list)."
            )
        for value in (*self.matmul_flops_per_s.values(), self.memory_bytes_per_s):
            if not value > 0:
                raise CheckpointUsageError(
                    f"remat.planner: DeviceRates({self.name!r}) rates must be positive, got {value!r}."
                )
        for name in ("op_overhead_s", "kernel_overhead_s", "policy_op_overhead_s"):
            if not getattr(self, name) >= 0:
                raise CheckpointUsageError(
                    f"remat.planner: DeviceRates({self.name!r}).{name} must be 0 or more seconds, "
                    f"got {getattr(self, name)!r}."
                )

    def describe(self) -> str:
        """One line: the device and where its rates come from."""
        source = "measured here" if self.measured else "datasheet"
        bf16 = self.flops_per_s(torch.bfloat16) / 1e12
        return (
            f"{self.name} ({source}: {self.flops_per_s(torch.float32) / 1e12:.3g} TFLOP/s fp32, "
            f"{bf16:.3g} bf16, {self.memory_bytes_per_s / 1e9:.4g} GB/s)"
        )

    def flops_per_s(self, dtype: torch.dtype) -> float:
        """Matmul throughput in ``dtype``."""
        return self.matmul_flops_per_s.get(dtype, self.matmul_flops_per_s[torch.float32])

    def kernel_s(self, flops: float, nbytes: float, dtype: torch.dtype, overhead_s: float) -> float:
        """One kernel's modelled time: bound by its FLOPs or its bytes, plus its fixed cost."""
        return max(flops / self.flops_per_s(dtype), nbytes / self.memory_bytes_per_s) + overhead_s

    @classmethod
    def named(cls, name: str) -> DeviceRates:
        """A device's datasheet rates (dense, no sparsity): one of :data:`DEVICES`.

        Example:
            >>> DeviceRates.named("a100").memory_bytes_per_s
            2039000000000.0
        """
        try:
            return DEVICES[name.lower()]
        except KeyError:
            raise CheckpointUsageError(
                f"remat.planner: no rates for a device named {name!r}; known: "
                f"{', '.join(sorted(DEVICES))}, or measure this machine's (DeviceRates.measure())."
            ) from None

    @classmethod
    def measure(cls, device: str | torch.device = "cpu") -> DeviceRates:
        """This machine's rates on ``device``: float32 and bfloat16 matmuls, a large copy,
        a small op, bare and under a selective policy's two modes (medians of a few runs,
        about a second in all).

        Example:
            >>> DeviceRates.measure().measured
            True
        """
        device = torch.device(device)
        sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

        def timed(work: Callable[[], Any], repeats: int) -> float:
            work()
            runs = []
            for _ in range(repeats):
                sync()
                start = time.perf_counter()
                work()
                sync()
                runs.append(time.perf_counter() - start)
            return statistics.median(runs)

        flops = {}
        for dtype in (torch.float32, torch.bfloat16):
            # Square matmuls, doubled in size until one takes long enough to time
            # (a CPU without bf16 units is a hundred times slower in bf16).
            size, seconds = 128, 0.0
            while seconds < _MATMUL_TIMED_S and size < _MATMUL_LARGEST:
                size *= 2
                square = torch.randn(size, size, device=device, dtype=dtype)
                seconds = timed(functools.partial(torch.mm, square, square), 3)
            flops[dtype] = 2 * size**3 / seconds
        source = torch.empty(32 * 2**20, dtype=torch.uint8, device=device)
        target = torch.empty_like(source)
        bandwidth = 2 * source.numel() / timed(lambda: target.copy_(source), 5)
        small = torch.zeros(16, device=device)
        op = timed(lambda: [small.add(1) for _ in range(_SMALL_OPS)], 5) / _SMALL_OPS
        # A compiled kernel skips the dispatcher: a fraction of an eager op's fixed cost.
        return cls(
            f"{device.type} (measured)", flops, bandwidth, op_overhead_s=op,
            kernel_overhead_s=op * _KERNEL_SHARE_OF_OP, measured=True,
            policy_op_overhead_s=op * max(_policy_op_share(small), 0.0),
        )


def _policy_op_share(small: torch.Tensor) -> float:
    """How much longer a small op takes under a save_matmuls region's modes than bare:
    the mean of the forward's (which asks the policy) and the recomputation's (which
    counts calls), as a selective block runs each op once in each. Medians of ratios of
    interleaved runs: the difference of two separate medians swung 2x between calls on a
    busy 2-core machine."""
    record, replay = SelectiveContexts(save_matmuls)()

    def ops() -> None:
        for _ in range(_SMALL_OPS):
            small.add(1)

    def recorded() -> None:
        record.cache.entries.clear()  # each run records its own calls, as a region does
        with record:
            ops()

    def replayed() -> None:
        with replay:  # counts its calls from zero at every entry
            ops()

    def seconds(work: Callable[[], None]) -> float:
        start = time.perf_counter()
        work()
        return time.perf_counter() - start

    recorded()  # what the replays read (and a warm-up)
    forward, recomputed = [], []
    for _ in range(_POLICY_ROUNDS):
        bare = seconds(ops)
        forward.append(seconds(recorded) / bare)
        recomputed.append(seconds(replayed) / bare)
    return (statistics.median(forward) + statistics.median(recomputed)) / 2 - 1


_KERNEL_SHARE_OF_OP = 0.25
_SMALL_OPS = 200
_POLICY_ROUNDS = 9
_MATMUL_TIMED_S = 0.02
_MATMUL_LARGEST = 8192

_HOST_POLICY_OP_S = 20e-6
"""A selective policy's modes per op on a datacenter GPU's host. No datasheet gives it:
it is Python on the host. Measured with :meth:`DeviceRates.measure` on a 2-core x86
machine (torch 2.13): 19-29 us over three calls, 2.6-3.1x a bare op there; 20 us here,
for the faster cores of GPU hosts."""

_bf16, _fp16, _fp32 = torch.bfloat16, torch.float16, torch.float32
DEVICES: dict[str, DeviceRates] = {
    "a100": DeviceRates("a100", {_fp32: 19.5e12, _bf16: 312e12, _fp16: 312e12}, 2.039e12, 10e-6, 4e-6,
                        policy_op_overhead_s=_HOST_POLICY_OP_S),
    "h100": DeviceRates("h100", {_fp32: 66.9e12, _bf16: 989.4e12, _fp16: 989.4e12}, 3.35e12, 10e-6, 4e-6,
                        policy_op_overhead_s=_HOST_POLICY_OP_S),
    "h200": DeviceRates("h200", {_fp32: 66.9e12, _bf16: 989.4e12, _fp16: 989.4e12}, 4.8e12, 10e-6, 4e-6,
                        policy_op_overhead_s=_HOST_POLICY_OP_S),
}
"""Datasheet rates (SXM parts, dense matmuls; fp32 without TF32, torch's default), with
a host's policy-mode cost (:data:`_HOST_POLICY_OP_S`)."""


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _signature(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any) -> tuple[object, ...] | None:
    """What an op's modelled time depends on: the op, each tensor's shape and dtype, the
    other arguments; None where an argument is not plain (then the op is costed anew)."""
    parts: list[object] = [func]
    for value in (args, tuple(kwargs.items()), out):
        if not _describe(value, parts):
            return None
    return tuple(parts)


def _describe(value: Any, parts: list[object]) -> bool:
    """Append ``value``'s description to ``parts``; False where it holds something not plain."""
    if isinstance(value, torch.Tensor):
        parts.append((value.shape, value.dtype))
    elif isinstance(value, (tuple, list)):
        parts.append(len(value))
        return all(_describe(item, parts) for item in value)
    elif isinstance(value, _PLAIN):
        parts.append(value)
    else:
        return False
    return True


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]


def tensor_bytes(tree: Any) -> int:
    """Bytes of the tensors in a nested structure (their elements, not their storages)."""
    return sum(t.numel() * t.element_size() for t in _tensors(tree))


_SDPA_FLOPS: Callable[..., int] = flop_counter.sdpa_flop_count
_SDPA_BACKWARD_FLOPS: Callable[..., int] = flop_counter.sdpa_backward_flop_count


def _flops(target: Any, args: Any, kwargs: Any, out: Any) -> int:
    """torch's FLOP formula for an op (0 for ops without one: memory-bound)."""
    formula = flop_counter.flop_registry.get(getattr(target, "overloadpacket", target))
    if formula is not None:
        return int(formula(*args, out_val=out, **kwargs))
    name = str(getattr(target, "__name__", ""))
    if "scaled_dot_product" in name and len(args) >= 3:
        # CPU attention kernels torch has no formula for: the math of attention.
        query, key, value = args[:3]
        if "backward" in name:
            query, key, value = args[1:4]
            return int(_SDPA_BACKWARD_FLOPS(args[0].shape, query.shape, key.shape, value.shape))
        return int(_SDPA_FLOPS(query.shape, key.shape, value.shape))
    return 0


def _dtype(tensors: list[torch.Tensor]) -> torch.dtype:
    return tensors[0].dtype if tensors else torch.float32


def graph_seconds(graph: fx.GraphModule, realized: frozenset[fx.Node], rates: DeviceRates) -> float:
    """Modelled time of one compiled graph, kernel by kernel.

    ``realized`` are the nodes that get a buffer (:class:`remat.memory.BufferPlan`):
    each is one kernel. An extern kernel (a matmul, attention) reads its
    inputs and writes its output; a fused kernel writes its output and reads
    the buffers (and graph inputs) its fused loops start from, each once.
    """
    total = 0.0
    sources: dict[fx.Node, frozenset[fx.Node]] = {}
    for node in graph.graph.nodes:
        if node.op == "placeholder" or node in realized:
            sources[node] = frozenset({node})
        elif node.op == "call_function":
            sources[node] = frozenset().union(*(sources.get(read, frozenset()) for read in node.all_input_nodes))
        if node not in realized:
            continue
        out = node.meta.get("val")
        reads = frozenset().union(*(sources.get(read, frozenset()) for read in node.all_input_nodes))
        nbytes = tensor_bytes(out) + sum(tensor_bytes(read.meta.get("val")) for read in reads)
        args = fx.node.map_arg(node.args, lambda read: read.meta.get("val"))
        kwargs = fx.node.map_arg(node.kwargs, lambda read: read.meta.get("val"))
        try:
            flops = _flops(node.target, args, kwargs, out)
        except Exception:  # a formula that does not take this overload's arguments: memory-bound
            flops = 0
        total += rates.kernel_s(flops, nbytes, _dtype(_tensors(out)), rates.kernel_overhead_s)
    return total


class ModelledClock(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A clock that advances by each op's modelled time (see the module docstring).

    Active as a dispatch mode around a step (on fake tensors, or real ones:
    nothing is timed for real), or told of the ops a memory tracker counts
    (``tracker.observe_ops(clock)``: one mode fewer that every op passes
    through), it sees every eager op; a compiled graph
    run under :func:`remat.memory.statically_compiled` reports itself
    instead (:meth:`compiled_graph_ran`) and is costed kernel by kernel.
    Views cost only their dispatch; a fake tensor's ``tensor.device()`` (an op only
    tensors with a device of their own dispatch) costs nothing. A selective region's
    modes, entered above the clock, tell it of every op they handle
    (:meth:`meter_policy_op`).
    """

    def __init__(self, rates: DeviceRates) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.rates = rates
        self._seconds = 0.0
        self._graph_seconds: dict[fx.GraphModule, float] = {}
        # An op's modelled time depends only on the op, its arguments' shapes and dtypes
        # and its non-tensor arguments: a step repeats most of its ops (every microbatch
        # through every alike block), so each is costed once (on Llama-3.1-8B's simulated
        # pipeline ranks the clock was a fifth of the time; torch's FLOP formulas and a
        # tree walk over the arguments per op).
        self._op_seconds: dict[tuple[object, ...], float] = {}

    def seconds(self) -> float:
        """Modelled seconds since the clock was made."""
        return self._seconds

    def meter_policy_op(self, func: Any) -> None:
        """A selective policy's dispatch mode handled ``func`` (found by the modes on the
        stack: ``remat._scope.policy_op_meter``): that mode's cost per op. A fake tensor's
        ``tensor.device()`` costs nothing here either: a run on real tensors never
        dispatches it (on fake ones the modes handle more of those than of any op)."""
        if func is not DEVICE_QUERY:
            self._seconds += self.rates.policy_op_overhead_s

    def compiled_graph_ran(self, graph: fx.GraphModule, realized: frozenset[fx.Node]) -> None:
        """A compiled graph ran: its kernels' modelled time (computed once per graph)."""
        seconds = self._graph_seconds.get(graph)
        if seconds is None:
            seconds = self._graph_seconds[graph] = graph_seconds(graph, realized, self.rates)
        self._seconds += seconds

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is not DEVICE_QUERY:  # a fake tensor's answer to tensor.device(): no work on a device
            self.op_ran(func, args, kwargs, out)
        return out

    def op_ran(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Advance by the op's modelled time. Called by the clock's own dispatch mode, or,
        where a memory tracker counts the same step, by the tracker's mode
        (``MemoryTracker.observe_ops``: :class:`remat._scope.OpObserver`), which saves
        every op a second mode on the stack."""
        key = _signature(func, args, kwargs, out)
        seconds = self._op_seconds.get(key) if key is not None else None
        if seconds is None:
            seconds = self._op_time(func, args, kwargs, out)
            if key is not None:
                self._op_seconds[key] = seconds
        self._seconds += seconds

    def _op_time(self, func: Any, args: Any, kwargs: Any, out: Any) -> float:
        outputs = _tensors(out)
        if func.is_view or not outputs:
            return self.rates.op_overhead_s  # metadata only
        try:
            flops = _flops(func, args, kwargs, out)
        except Exception:  # as in graph_seconds
            flops = 0
        nbytes = tensor_bytes(outputs) + tensor_bytes((args, kwargs))
        return self.rates.kernel_s(flops, nbytes, _dtype(outputs), self.rates.op_overhead_s)
