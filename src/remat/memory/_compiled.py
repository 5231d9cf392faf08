"""Compiled blocks tracked without running a kernel: the compiler's saved tensors and buffers.

Layer: ``remat.memory``, above :mod:`remat.placement` (the calls it compiles
blocks with) and :mod:`remat._compat` (inductor's front end, the dispatch stack);
inductor's buffer plan is read in :mod:`remat.memory._buffer_plan`.

Inside :func:`statically_compiled`, every compiled module of a model (a block
remat compiles, ``BlockSetting(compile=...)`` or a compiled plan, or one
``module.compile()`` compiled) runs through a compiler that makes inductor's
trace-time decisions and none of its run-time ones:

* Dynamo captures the block's forward as it would, under torch's default
  partitioner settings (as remat always compiles);
* inductor's decompositions, joint-graph passes and min-cut partitioner
  split it into a forward and a backward graph, so what the forward saves for
  backward is the compiler's own choice, made on fake tensors;
* inductor lowers each graph, fuses and orders its kernels and plans its
  buffers, and is stopped before it compiles a kernel
  (``remat.memory._buffer_plan.inductor_buffer_timeline``);
* each graph then runs node by node on the tensors it is given (fake ones
  allocate nothing) for its values, and a memory tracker
  (:func:`remat.memory.track`) sees inductor's planned buffers come and go,
  not every op's output (:class:`BufferPlan`; where inductor cannot lower a
  graph here, a model of which nodes become buffers, with a warning).

A compiled training step of a model far too large for the machine is then
tracked as :func:`remat.memory.track_training_step` tracks an eager one, per
rank under :func:`remat.memory.estimate_sharded_step`. How each part is
decided, and the measured error: ``docs/design/compile.md``, "Static estimates".

Example:
    >>> import torch
    >>> from remat.memory import statically_compiled, track
    >>> from remat.placement import BlockSetting, CompileSpec, place
    >>> class MLP(torch.nn.Module):
    ...     def __init__(self) -> None:
    ...         super().__init__()
    ...         self.up, self.down = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)
    ...     def forward(self, x: torch.Tensor) -> torch.Tensor:
    ...         return self.down(torch.nn.functional.gelu(self.up(x)))
    >>> model = torch.nn.Sequential(MLP())
    >>> handle = place(model, {"0": BlockSetting(checkpoint=False, compile=CompileSpec())})
    >>> x = torch.randn(32, 64)
    >>> with statically_compiled(model) as compilation, track() as tracker:
    ...     model(x).sum().backward()
    >>> compilation.graphs_compiled          # one forward and one backward graph
    2
    >>> tracker.peak_bytes > 0
    True
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from remat._compat.dispatch import (
    HigherOrderOperator,
    OpOverload,
    dispatch_modes_pushed,
    user_dispatch_modes_popped,
)
from remat._compat.dynamo import compile_cache_room
from remat._compat.fake import fake_mode_of
from remat._compat.inductor import inductor_front_end
from remat._compat.modules import compiled_call, module_call, set_compiled_call
from remat._compat.versions import static_compile_supported
from remat._scope import COMPILED_GRAPH_RAN
from remat.errors import CheckpointUsageError, UnsupportedCheckpointError
from remat.memory._buffer_plan import inductor_buffer_timeline
from remat.memory._tracker import tracker_of
from remat.placement import CompileSpec, DefaultPartitionerCall

__all__ = ["BufferPlan", "StaticCompilation", "statically_compiled"]

_API = "remat.memory.statically_compiled"

_aten = torch.ops.aten

# Ops inductor lowers to loops it fuses into their consumers, as it does the
# ops tagged pointwise: copies, casts, gathers, pads, fills and masks.
_LOOPS = frozenset(
    getattr(_aten, name)
    for name in (
        "_to_copy", "copy", "index", "gather", "constant_pad_nd", "full", "arange", "iota",
        "scalar_tensor", "slice_scatter", "select_scatter", "tril", "triu", "rand", "randn",
        "bernoulli", "fill", "zeros", "ones", "empty_like", "full_like", "zeros_like",
    )
    if hasattr(_aten, name)
)
# Reductions: a buffer of their own, their inputs computed inside their loops.
_REDUCTIONS = frozenset(
    getattr(_aten, name)
    for name in (
        "sum", "mean", "amax", "amin", "var_mean", "var", "std", "prod", "max", "min",
        "argmax", "argmin", "any", "all", "logsumexp",
    )
    if hasattr(_aten, name)
)
# Ops that return their input's memory reinterpreted, though not views by schema.
_ALIASES = frozenset(
    getattr(_aten, name) for name in ("_unsafe_view", "reshape", "alias", "view_as") if hasattr(_aten, name)
)
_CONCATENATIONS = frozenset({_aten.cat})

_REALIZE_READS = 4
"""A loop read by more consumers than this gets a buffer of its own (inductor's
``realize_reads_threshold``) rather than being computed again in each."""


def _packet(target: Any) -> Any:
    return getattr(target, "overloadpacket", target)


def _kind(node: fx.Node) -> str:
    """"view", "loop", "reduction", "concatenation" or "kernel" (an extern call: matmuls,
    attention, custom and higher-order ops); "other" for placeholders, attributes, outputs."""
    if node.op != "call_function":
        return "other"
    target = node.target
    if target is operator.getitem or getattr(target, "is_view", False) or _packet(target) in _ALIASES:
        return "view"
    packet = _packet(target)
    if isinstance(target, OpOverload) and (torch.Tag.pointwise in target.tags or packet in _LOOPS):
        return "loop"
    if packet in _REDUCTIONS:
        return "reduction"
    if packet in _CONCATENATIONS:
        return "concatenation"
    return "kernel"


def _base(node: fx.Node) -> fx.Node:
    """The node whose memory ``node`` is: itself, or what a chain of views reads."""
    while _kind(node) == "view" and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


class BufferPlan:
    """One partitioned graph, run node by node with inductor's buffers shown to memory trackers.

    With a ``timeline`` (inductor's own buffer plan for the graph, from
    ``remat.memory._buffer_plan.inductor_buffer_timeline``: allocations and frees in
    the order its code makes them), the graph runs for its values with no
    tracker watching, then the trackers see the timeline's buffers come and
    go, and the graph's inputs let go where the code lets go of them; the
    outputs' buffers become the output values. This is exact against the
    allocator's count of the real compiled step (``docs/design/compile.md``,
    "Static estimates").

    Without one (inductor could not lower the graph here), a model of which
    nodes get a buffer stands in. Inductor does not allocate every op's output. It fuses loops (pointwise
    ops, casts, gathers) into the kernels that read them, so their results
    live in registers; a node gets a buffer (it is *realized*) when:

    * it is a graph output (what the forward saves, the backward's gradients);
    * it is computed by an extern kernel (a matmul, attention, a custom or
      higher-order op), or it is an input of one (those read memory);
    * it is a reduction, or a concatenation;
    * it is a loop read by more than four consumers (recomputing it in each
      would cost more than storing it).

    Views cost nothing. A buffer is freed after its last reader, as
    inductor's generated code frees it; the graph's inputs too, when the
    caller handed them over (the backward's saved tensors). The model
    cannot see what inductor's fusion keeps live at once (a recomputed gated
    MLP's buffers), so it reads low there: it stands in only where
    inductor's own plan is missing, and says so (a warning).

    A dispatch mode active around the graph sees its ops one by one, except
    a memory tracker (shown the buffers only) and a mode with a
    ``compiled_graph_ran(graph, realized)`` method, which is told of each
    run instead (:class:`remat.planner.timing.ModelledClock` costs the graph
    kernel by kernel).

    Attributes:
        graph: the aten graph inductor would generate code for.
        timeline: inductor's buffer plan, or None where it is modelled.
        realized: the nodes that get a buffer in the model (the time model's
            kernels, :mod:`remat.planner.timing`).
        peak_bytes: the highest sum of live buffers while the graph runs, with
            its inputs not counted (a static figure: the timeline's, else the model's).
        runs: how many times it ran.
    """

    def __init__(self, graph: fx.GraphModule, timeline: Sequence[tuple[str, int, int]] | None = None) -> None:
        self.graph = graph
        self.timeline = None if timeline is None else tuple(timeline)
        # AOTAutograd hands over its argument list, which the plan clears (an
        # instance attribute: torch's wrappers copy the instance dict only).
        self._boxed_call = True
        nodes = list(graph.graph.nodes)
        output = nodes[-1]
        realized = {_base(node) for node in output.all_input_nodes}
        for node in nodes:
            kind = _kind(node)
            if kind == "kernel":
                realized.add(node)
                realized.update(_base(read) for read in node.all_input_nodes)
            elif kind in ("reduction", "concatenation"):
                realized.add(node)
            elif kind == "loop" and len(node.users) > _REALIZE_READS:
                realized.add(node)
        self.realized = frozenset(node for node in realized if node.op == "call_function")
        self._nodes = nodes
        last_read: dict[fx.Node, int] = {}
        for index, node in enumerate(self._nodes):
            for read in node.all_input_nodes:
                last_read[read] = index
        self._dead_after: dict[int, list[fx.Node]] = {}
        for node, index in last_read.items():
            self._dead_after.setdefault(index, []).append(node)
        self.peak_bytes = self._static_peak() if self.timeline is None else _timeline_peak(self.timeline)
        self.runs = 0

    def _static_peak(self) -> int:
        live = peak = 0
        outputs = {_base(node) for node in self._nodes[-1].all_input_nodes}
        sizes = {node: _node_bytes(node) for node in self.realized}
        for index, node in enumerate(self._nodes):
            live += sizes.get(node, 0)
            peak = max(peak, live)
            for dead in self._dead_after.get(index, ()):
                if dead in sizes and dead not in outputs:
                    live -= sizes[dead]
        return peak

    def __call__(self, args: list[Any]) -> Any:
        inputs = list(args)
        args.clear()  # the inputs die with their last reader, as in inductor's code
        self.runs += 1
        held = _HELD_MODES.get()
        with user_dispatch_modes_popped() as popped:
            modes = [*popped, *held]
            for tracker in filter(None, map(tracker_of, modes)):
                tracker.compiled_graph_starts()
            with _fake_mode_for(inputs):
                return self._run(inputs, modes)

    def _run(self, inputs: list[Any], modes: Sequence[Any]) -> Any:
        """Run the graph on ``inputs``, a list it takes over: each input is let go
        where the code lets go of it (a saved tensor after its last reader).

        Memory trackers see the graph's buffers: inductor's timeline where there is
        one, else the modelled realized nodes as they are computed. A mode that
        takes a graph whole (``compiled_graph_ran``: remat.planner.timing's clock
        costs it kernel by kernel) is told of the run; the other modes see the ops.
        """
        trackers, others = [], []
        for mode in modes:
            tracker = tracker_of(mode)
            observe = getattr(mode, COMPILED_GRAPH_RAN, None)
            if callable(observe):  # a tracker's mode too, where its op observer takes graphs
                observe(self.graph, self.realized)
            if tracker is not None:
                trackers.append(tracker)
            elif not callable(observe):
                others.append(mode)
        if self.timeline is None:
            return self._interpret(inputs, others, trackers)
        held = list(inputs)  # the code's references to its inputs, dropped where it drops them
        result = self._interpret(inputs, others, ())
        device = _first_device((result, held))
        buffers: dict[int, torch.Tensor] = {}
        for kind, key, nbytes in self.timeline:
            if kind == "allocate":
                buffers[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
                for tracker in trackers:
                    tracker.count_compiled_output(_INDUCTOR_BUFFER, (), buffers[key])
            elif kind == "free":
                del buffers[key]
            else:
                held[key] = None
        buffers.clear()  # the outputs' buffers, handed back as the graph's values
        for tracker in trackers:
            tracker.count_compiled_output(_INDUCTOR_BUFFER, held, result)
        return result

    def _interpret(self, inputs: list[Any], seen_by: Sequence[Any], trackers: Sequence[Any]) -> Any:
        """The graph's values, node by node, with the modes ``seen_by`` seeing its ops and
        ``trackers`` shown each realized node's output (the model's buffers)."""
        values: dict[fx.Node, Any] = {}
        placeholders = iter(range(len(inputs)))
        for index, node in enumerate(self._nodes):
            if node.op == "placeholder":
                # Taken out of the list: an input lives as long as the graph reads it.
                position = next(placeholders)
                values[node], inputs[position] = inputs[position], None
            elif node.op == "get_attr":
                values[node] = getattr(self.graph, str(node.target))
            elif node.op == "call_function":
                args = fx.node.map_arg(node.args, values.__getitem__)
                kwargs = fx.node.map_arg(node.kwargs, values.__getitem__)
                # The other user modes (a simulated process group's waits) see
                # the ops; higher-order ops run their own inner ops, unseen.
                with dispatch_modes_pushed(() if isinstance(node.target, HigherOrderOperator) else seen_by):
                    values[node] = node.target(*args, **kwargs)
                if node in self.realized:
                    for tracker in trackers:
                        tracker.count_compiled_output(node.target, (args, kwargs), values[node])
                del args, kwargs
            elif node.op == "output":
                result = fx.node.map_arg(node.args[0], values.__getitem__)
                values.clear()
                return result
            for dead in self._dead_after.get(index, ()):
                values.pop(dead, None)
        raise AssertionError("remat bug: a graph without an output node")


_INDUCTOR_BUFFER = "inductor buffer"
"""The op a tracker records for a buffer of inductor's plan (it has no aten op)."""


def _timeline_peak(timeline: Sequence[tuple[str, int, int]]) -> int:
    sizes: dict[int, int] = {}
    live = peak = 0
    for kind, key, nbytes in timeline:
        if kind == "allocate":
            sizes[key] = nbytes
            live += nbytes
            peak = max(peak, live)
        elif kind == "free":
            live -= sizes.pop(key)
    return peak


def _first_device(values: Any) -> torch.device:
    for value in _values(values):
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def _node_bytes(node: fx.Node) -> int:
    total = 0
    for value in _values(node.meta.get("val")):
        if isinstance(value, torch.Tensor):
            total += value.untyped_storage().nbytes()
    return total


def _values(value: Any) -> Iterator[Any]:
    if isinstance(value, (tuple, list)):
        for item in value:
            yield from _values(item)
    else:
        yield value


def _fake_mode_for(inputs: Sequence[Any]) -> contextlib.AbstractContextManager[Any]:
    """The inputs' fake-tensor mode, entered unless it is active: a graph's factory ops
    (zeros, full) must make fake tensors too, or a large model's would be real."""
    mode = fake_mode_of(inputs)
    return contextlib.nullcontext() if mode is None else mode


_HELD_MODES: ContextVar[tuple[Any, ...]] = ContextVar("remat_static_compile_held_modes", default=())
"""The user dispatch modes a static block call popped so that Dynamo compiles its
frame: the forward graph's plan shows its buffers to the trackers among them."""


@dataclass
class StaticCompilation:
    """What :func:`statically_compiled` compiled: the blocks and their graphs.

    Attributes:
        blocks: paths of the compiled modules ("" for the model itself).
        plans: every partitioned graph compiled, in order (forward graphs
            while the forward runs, backward graphs when backward first
            reaches them).
    """

    blocks: tuple[str, ...]
    plans: list[BufferPlan] = field(default_factory=list)

    @property
    def modelled(self) -> int:
        """How many graphs inductor could not plan here: their buffers are modelled
        (a :class:`BufferPlan` without a timeline)."""
        return sum(plan.timeline is None for plan in self.plans)

    def runs(self) -> int:
        """How many times its graphs ran."""
        return sum(plan.runs for plan in self.plans)

    @property
    def graphs_compiled(self) -> int:
        """How many graphs were compiled (a forward and a backward per distinct block)."""
        return len(self.plans)

    def _compile(self, graph: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        """The torch.compile backend: inductor's front end, then a :class:`BufferPlan` per graph."""
        return inductor_front_end(graph, example_inputs, self._plan)

    def _plan(self, graph: fx.GraphModule, example_inputs: Sequence[Any], **graph_kwargs: Any) -> BufferPlan:
        try:
            timeline = inductor_buffer_timeline(graph, example_inputs, **graph_kwargs)
            why = "it wrote no Python wrapper code: its C++ wrapper is on"
        except Exception as error:  # inductor's own failure to lower: the graph is modelled instead
            timeline, why = None, f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
        if timeline is None:
            warnings.warn(
                f"{_API}: inductor could not plan the buffers of a compiled graph here ({why}); its "
                "buffers are modelled instead (BufferPlan), which was 0-16% low on recomputed "
                "blocks (docs/design/compile.md, 'Static estimates').",
                stacklevel=2,
            )
        plan = BufferPlan(graph, timeline)
        self.plans.append(plan)
        return plan


class _StaticBlockCall:
    """A compiled module's call under a static estimate: its call (hooks and
    forward, as ``module.compile()`` compiles it) compiled by
    :class:`StaticCompilation`, and run with the user dispatch modes popped
    (Dynamo compiles no frame under one), which it hands to the graphs' plans
    and whose trackers it tells where the module starts and ends."""

    def __init__(self, module: nn.Module, spec: CompileSpec, compilation: StaticCompilation, path: str) -> None:
        self._module = module
        self._path = path
        self._call = DefaultPartitionerCall(
            torch.compile(module_call(module), backend=compilation._compile, **_arguments(spec)), spec
        )
        self._compilation = compilation

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        runs_before = self._compilation.runs()
        with user_dispatch_modes_popped() as popped:
            trackers = [t for t in (tracker_of(mode) for mode in popped) if t is not None]
            paths = [tracker.enter_compiled_module(self._module) for tracker in trackers]
            held = _HELD_MODES.set((*popped, *_HELD_MODES.get()))
            try:
                result = self._call(*args, **kwargs)
            finally:
                _HELD_MODES.reset(held)
        for tracker, path in zip(trackers, paths, strict=True):
            if path is not None:
                tracker.exit_compiled_module(path, result)
        if self._compilation.runs() == runs_before:
            # Dynamo ran the frame eagerly (it skipped it, or ran out of versions):
            # what was tracked is the eager forward, not the compiled one.
            raise UnsupportedCheckpointError(
                f"{_API}: the compiled module {self._path or type(self._module).__name__!r} ran "
                "without its compiled graph (torch.compile fell back to running it eagerly), so its "
                "compiled memory cannot be told; estimate it eagerly, or measure it "
                "(remat.memory.measure_training_step)."
            )
        return result


def _arguments(spec: CompileSpec) -> dict[str, Any]:
    """torch.compile's arguments for ``spec`` but the backend (a mode is inductor's own:
    it changes kernels and autotuning, not what is saved or which buffers exist).

    Shapes are static unless the spec asks for dynamic ones: a training job's
    first compile specializes them, while Dynamo's automatic dynamic shapes
    remember, for the whole process, every shape a function was compiled for
    before, and a graph with symbolic sizes cannot be memory-planned on its fake
    inputs. The estimate is then the same in any process.
    """
    arguments = spec.arguments()
    arguments.pop("backend", None)
    arguments.pop("mode", None)
    if arguments.get("dynamic") is None:
        arguments["dynamic"] = False
    return arguments


@contextlib.contextmanager
def statically_compiled(model: nn.Module) -> Iterator[StaticCompilation]:
    """Run the model's compiled modules through a static compiler for a block of code.

    Every module of ``model`` that is compiled (by remat's placement or
    planner, or ``module.compile()``) is compiled, for the length of the
    block, by a compiler that decides as inductor does at trace time (its
    decompositions, joint passes and partitioner) and generates no kernel:
    each graph runs op by op on the tensors it gets, and a memory tracker
    active around it counts inductor's buffers (:class:`BufferPlan`). With
    fake tensors nothing is allocated, so a compiled step of any size is
    tracked in seconds. A tracker marks each compiled module's call; the
    modules inside it are inside its graphs.

    Raises:
        CheckpointUsageError: ``model`` has no compiled module.
        UnsupportedCheckpointError: torch older than 2.11 (its Dynamo hands
            fake tensors to the compiler in a mode of their own, which
            inductor refuses).

    Example:
        >>> import torch
        >>> from remat.placement import BlockSetting, CompileSpec, place
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
        >>> handle = place(model, {"0": BlockSetting(compile=CompileSpec()), "1": BlockSetting(compile=CompileSpec())})
        >>> with statically_compiled(model) as compilation:
        ...     model(torch.randn(4, 8, requires_grad=True)).sum().backward()
        >>> compilation.blocks, compilation.graphs_compiled
        (('0', '1'), 4)
    """
    if not isinstance(model, nn.Module):
        raise CheckpointUsageError(f"{_API}: model must be a torch.nn.Module, got {type(model).__name__}.")
    if not static_compile_supported():
        raise UnsupportedCheckpointError(
            f"{_API}: estimating compiled blocks without running them needs torch 2.11 or newer "
            f"(this is {torch.__version__}, whose torch.compile cannot compile fake tensors made "
            "outside it); measure the compiled step instead (remat.memory.measure_training_step, "
            "remat estimate --compile --measure), or upgrade torch."
        )
    compiled = [(path, module) for path, module in model.named_modules() if compiled_call(module) is not None]
    if not compiled:
        raise CheckpointUsageError(
            f"{_API}: {type(model).__name__} has no compiled module; compile its blocks first "
            "(remat.placement.BlockSetting(compile=CompileSpec()), or module.compile()), or track it eagerly."
        )
    compilation = StaticCompilation(tuple(path for path, _ in compiled))
    previous: list[tuple[nn.Module, Any]] = []
    # Every block's call shares one code object (nn.Module._call_impl): blocks of
    # other classes or shapes each need a version, beyond Dynamo's default limit.
    with compile_cache_room(2 * len(compiled) + 2):
        try:
            for path, module in compiled:
                call = compiled_call(module)
                spec = call.spec if isinstance(call, DefaultPartitionerCall) else CompileSpec(fullgraph=False)
                previous.append((module, set_compiled_call(module, _StaticBlockCall(module, spec, compilation, path))))
            yield compilation
        finally:
            for module, call in reversed(previous):
                set_compiled_call(module, call)
            torch.compiler.reset()  # the static versions must not serve a later real run
