"""The reentrant variant (``use_reentrant=True``): one autograd node per region.

The forward runs under ``no_grad``; in backward the region's node reruns the
function with grad enabled and differentiates it in a nested ("reentrant")
backward, as torch does. Unlike torch's (``docs/design/reentrant.md``):

* a torch-function mode watches the forward and notes each use of a tensor
  that requires grad: the inputs and what the function reads by closure
  (parameters, activations made outside the region);
* the node has one edge per use, so those gradients leave the region as the
  inputs' do, into the outer backward, in the order autograd adds them
  without checkpointing (bitwise the unchecked sums);
* the recomputation gives each use a stand-in leaf, and the nested backward
  is ``torch.autograd.grad`` with respect to the stand-ins: it never walks
  into (and frees) the graph outside the region, so ``retain_graph``,
  several losses, ``torch.autograd.grad`` and ``backward(inputs=...)`` work.

* under ``create_graph=True`` (double backward) the recomputation's graph is
  kept and reaches the targets, so the second backward goes through it as it
  goes through the unchecked graph.

Documented limits, each an error or a warning naming ``use_reentrant=False``:
autograd called inside the function (its forward runs under ``no_grad``),
keyword arguments, tensors returned inside containers (``autograd.Function``
connects only top-level tensors to the graph), and a tensor that a custom
``autograd.Function`` takes without the forward reading it in Python, whose
gradient reaches it as torch gives it (a nested backward of its own), so only
under a plain ``.backward()``.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterable
from contextvars import ContextVar
from typing import Any

import torch
from torch.autograd.graph import GradientEdge
from torch.overrides import TorchFunctionMode

from remat._compat import (
    AccumulateGrad,
    accumulate_through,
    backward_from_edges_supported,
    backward_key,
    is_checkpoint_valid,
    is_edgeless_view,
    next_sequence_nr,
    node_sequence_nr,
    version_of,
)
from remat._engine.forward_state import ReplayState, tensor_leaves
from remat.errors import CheckpointError, CheckpointTypeError

__all__ = ["check_backward_validity", "detach_variable", "run_reentrant"]


def check_backward_validity(inputs: Iterable[Any]) -> None:
    """Warn when no tensor input requires grad (the gradients would all be None).

    Example:
        >>> import torch, remat
        >>> remat.check_backward_validity([torch.ones(1, requires_grad=True)])
    """
    if not any(isinstance(value, torch.Tensor) and value.requires_grad for value in inputs):
        warnings.warn(
            "None of the inputs have requires_grad=True. Gradients will be None",
            stacklevel=2,
        )


def detach_variable(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """Detach each tensor of a tuple, keeping its ``requires_grad`` flag.

    Example:
        >>> import torch, remat
        >>> (y,) = remat.detach_variable((torch.ones(1, requires_grad=True),))
        >>> y.requires_grad, y.grad_fn is None
        (True, True)
    """
    if not isinstance(inputs, tuple):
        raise CheckpointTypeError(
            "detach_variable takes a tuple of tensors (other values pass through); "
            f"got {type(inputs).__name__}"
        )
    detached = []
    for value in inputs:
        if isinstance(value, torch.Tensor):
            copy = value.detach()
            copy.requires_grad = value.requires_grad
            detached.append(copy)
        else:
            detached.append(value)
    return tuple(detached)


# What autograd says when backward meets a tensor without history; inside the
# reentrant forward (run under no_grad) that is every tensor, so a function that
# calls torch.autograd.grad or .backward() itself fails with it.
_NO_GRAPH = "does not require grad and does not have a grad_fn"


def _backward_inside_advice(api: str) -> str:
    return (
        f"{api}(use_reentrant=True): the checkpointed function runs autograd itself "
        "(torch.autograd.grad or .backward() inside the region), but the reentrant "
        "variant runs the forward under torch.no_grad(), so no tensor in it has a "
        "graph. Pass use_reentrant=False (recommended), which supports backward "
        "inside the checkpointed function."
    )


def _warn_on_nested_tensors(outputs: Any, api: str) -> None:
    """Warn when tensors come back inside containers: autograd.Function tracks
    only tensors returned directly (or in a top-level tuple)."""
    items = outputs if isinstance(outputs, tuple) else (outputs,)
    for item in items:
        if isinstance(item, torch.Tensor) or item is None:
            continue
        if any(isinstance(leaf, torch.Tensor) for leaf in tensor_leaves((item,))):
            from remat._source import user_stacklevel  # a warning only: keep import remat lean

            warnings.warn(
                f"{api}(use_reentrant=True) returned tensors inside a "
                f"{type(item).__name__}: the reentrant variant only connects tensors "
                "returned directly or in a tuple to the graph, so these come back without "
                "grad_fn and their gradients are lost. Pass use_reentrant=False "
                "(recommended), which supports nested outputs, or return a tuple of tensors.",
                stacklevel=user_stacklevel(),
            )
            return


# Properties that make a new autograd edge to the tensor they are read from
# (``w.T`` is a view with a gradient). Reading any other property is not a use.
_EDGE_PROPERTIES = frozenset({"T", "mT", "H", "mH", "real", "imag"})


class _Record:
    """The forward's frame: the tensors it uses that require grad, use by use.

    The forward runs under ``no_grad``, so a tensor that requires grad there
    was made outside the region (an input, a closure, a parameter); a view of
    one taken inside is edgeless and stands for nothing new (its base was
    used by the view op). Each use is kept with the tensor the call really
    received: inside an enclosing recomputation, that is the enclosing
    region's stand-in for this use, and the node's edge goes there.
    """

    __slots__ = ("call", "index", "read_targets", "tensors", "uses")

    def __init__(self) -> None:
        self.index: dict[int, int] = {}  # id() of a tensor in ``tensors`` (kept alive there)
        self.tensors: list[torch.Tensor] = []
        self.uses: list[tuple[int, int, torch.Tensor]] = []  # (call, target, tensor received)
        self.read_targets: set[int] = set()  # read: a use, a property, an inner region's argument
        self.call = 0

    def target(self, tensor: torch.Tensor) -> int:
        """The index of ``tensor`` among the region's targets (added if new)."""
        known = self.index.get(id(tensor))
        if known is None:
            known = self.index[id(tensor)] = len(self.tensors)
            self.tensors.append(tensor)
        return known

    def touch(self, tensor: torch.Tensor, read: bool = True) -> int | None:
        """A tensor the forward reads (a property, a use), or with ``read=False``
        one the region takes as an input: its target, if it is one."""
        known = self.index.get(id(tensor))
        if known is None and tensor.requires_grad and not is_edgeless_view(tensor):
            known = self.target(tensor)
        if read and known is not None:
            self.read_targets.add(known)
        return known

    def see(self, original: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        target = self.touch(original)
        if target is not None:
            self.uses.append((self.call, target, current))
        return current

    def read(self, original: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        self.touch(original)
        return current

    def end_call(self, out: Any) -> None:
        self.call += 1


class _Substitute:
    """The recomputation's frame: each use of a target gets a stand-in leaf of its own.

    A stand-in shares the target's data and version counter but has no
    history, so the recomputed graph ends at the stand-ins: the nested
    backward cannot walk into the graph outside the region, and the gradient
    of each use comes back separately. (A recomputation runs in backward,
    never inside another region's frame.)
    """

    __slots__ = ("call", "doors", "index", "leaves", "quiet", "reads", "standins")

    def __init__(self, index: dict[int, int], doors: list[torch.Tensor | None] | None = None) -> None:
        # id() of each tensor that stands for a target; the backward keeps
        # them alive (arguments, captures), the stand-ins live in ``standins``.
        self.index = index
        # Under double backward, one tensor per target that every use gets
        # instead of a stand-in of its own (see _recompute_inputs); else None.
        self.doors = doors
        self.call = 0
        self.standins: list[tuple[int, int, torch.Tensor]] = []  # (call, target, stand-in)
        # Uses made with grad off: inside a custom Function's forward, whose
        # node takes the target itself. (Position in ``standins``, and the
        # sequence number after that node's: the next one.)
        self.quiet: list[tuple[int, int]] = []
        self.reads: list[tuple[int, torch.Tensor]] = []  # (target, stand-in) of an inner region's edge
        self.leaves: list[torch.Tensor] = []  # leaves that require grad, made by the region

    def touch(self, tensor: torch.Tensor) -> int | None:
        return None

    def _standin(self, original: torch.Tensor, current: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        """The target ``original`` is and what stands for it here (its door when
        doors are kept, else a new leaf); None when it is no target."""
        target = self.index.get(id(original))
        if target is None:
            return None
        if self.doors is not None:
            return target, self.doors[target]  # type: ignore[return-value]  # alive: indexed
        standin = current.detach()
        standin.requires_grad_(True)
        return target, standin

    def see(self, original: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        found = self._standin(original, current)
        if found is None or self.doors is not None:
            return current if found is None else found[1]
        target, standin = found
        if not torch.is_grad_enabled() and len(_frames.get()) == 1:  # (not an inner region's forward)
            self.quiet.append((len(self.standins), next_sequence_nr()))
        self.standins.append((self.call, target, standin))
        # An op may hand its argument back (remat.name, in-place ops): where
        # the forward then used the target again, this is used again.
        self.index[id(standin)] = target
        return standin

    def read(self, original: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        """A stand-in for an edge of a region nested in this recomputation that
        goes to a target with no use of its own (an input the inner function
        never used): its gradient reaches the target whole, as a capture does."""
        found = self._standin(original, current)
        if found is None or self.doors is not None:
            return current if found is None else found[1]
        self.reads.append(found)
        return found[1]

    def end_call(self, out: Any) -> None:
        self.call += 1
        if isinstance(out, torch.Tensor) and out.requires_grad and out.grad_fn is None:
            self.leaves.append(out)


_Frame = _Record | _Substitute
_frames: ContextVar[tuple[_Frame, ...]] = ContextVar("remat_reentrant_frames", default=())


def _through(frames: tuple[_Frame, ...], values: Any) -> Any:
    """``values`` (a tuple or list of call arguments) with every tensor passed
    through the frames, outermost first; the same object when nothing changed."""
    changed: list[Any] | None = None
    for position, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            new = value
            for frame in frames:
                new = frame.see(value, new)
        elif type(value) in (list, tuple):  # TensorList arguments (torch.cat)
            new = _through(frames, value)
        else:
            continue
        if new is not value:
            if changed is None:
                changed = list(values)
            changed[position] = new
    if changed is None:
        return values
    return tuple(changed) if isinstance(values, tuple) else changed


def _read(frames: tuple[_Frame, ...], tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as an edge of a node made inside the ``frames`` (outermost
    first): inside an enclosing recomputation, a stand-in of its own. (Called
    with no frames active: making it is no use they should see.)"""
    current = tensor
    for frame in frames:
        current = frame.read(tensor, current)
    return current


class _UsesMode(TorchFunctionMode):
    """Shows every torch call of the active reentrant regions to their frames.

    One instance serves all nested regions, so that an inner region records
    the stand-ins an enclosing recomputation substituted (frames run outermost
    first); it is entered with the first frame and left with the last.
    """

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        frames = _frames.get()
        if getattr(func, "__name__", None) == "__get__":
            name = getattr(getattr(func, "__self__", None), "__name__", None)
            if name not in _EDGE_PROPERTIES:
                # Reading .shape is no use, but a custom autograd.Function may
                # take the tensor as it is: it must be one of the region's targets.
                if args and isinstance(args[0], torch.Tensor):
                    for frame in frames:
                        frame.touch(args[0])
                return func(*args, **kwargs)
        args = _through(frames, args)
        if kwargs:
            values = tuple(kwargs.values())
            new = _through(frames, values)
            if new is not values:
                kwargs = dict(zip(kwargs, new, strict=True))
        out = func(*args, **kwargs)
        for frame in frames:
            frame.end_call(out)
        return out


class _Active:
    """Push a frame on ``outer`` (the active frames) for the block, and the
    mode if it is the first frame."""

    __slots__ = ("frame", "mode", "outer", "token")

    def __init__(self, frame: _Frame, outer: tuple[_Frame, ...] | None = None) -> None:
        self.frame = frame
        self.outer = outer
        self.mode: _UsesMode | None = None
        self.token: Any = None

    def __enter__(self) -> None:
        frames = _frames.get() if self.outer is None else self.outer
        self.token = _frames.set((*frames, self.frame))
        if not frames:
            self.mode = _UsesMode()
            self.mode.__enter__()  # type: ignore[no-untyped-call]

    def __exit__(self, *exc: object) -> None:
        if self.mode is not None:
            self.mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        _frames.reset(self.token)


class _State:
    """What a region's backward needs, set up by :func:`run_reentrant`."""

    __slots__ = (
        "api",
        "args",
        "edges_of",
        "function",
        "input_targets",
        "materialized",
        "outputs",
        "positions",
        "replay",
        "targets",
        "use_edges",
        "use_targets",
    )

    def __init__(self, function: Callable[..., Any], api: str, replay: ReplayState, args: tuple[Any, ...]) -> None:
        self.function = function
        self.api = api
        self.replay = replay
        self.positions = [i for i, value in enumerate(args) if isinstance(value, torch.Tensor)]
        self.args: list[Any] = [None if isinstance(value, torch.Tensor) else value for value in args]
        self.input_targets: list[int] = []  # per tensor input: its target, -1 for a constant
        # Per target: the tensor (weakly: what the function reads keeps it alive)
        # and its version when the forward ended.
        self.targets: list[tuple[weakref.ref[torch.Tensor], int]] = []
        # Per target: its edges, in the order autograd adds their gradients.
        self.edges_of: list[list[int]] = []
        self.use_targets: list[int] = []  # per use in the forward: its target
        self.use_edges: list[int] = []  # per use in the forward: its edge
        self.outputs: Any = None
        # A recomputation made under create_graph=True before this region's own
        # backward needed it (see _materialize), with the backward call it is for.
        self.materialized: tuple[Hashable, _Recomputed] | None = None

    def lay_out(self, record: _Record, frames: tuple[_Frame, ...]) -> list[torch.Tensor]:
        """The node's edges: per target one per use, latest call first (the order
        in which autograd adds the uses' gradients without checkpointing; a
        call's arguments in order), or one for a target the forward only read
        (a custom autograd.Function's input). At the top level, none for an
        input it never read: an edge would make autograd run the input's node
        with no gradient, which a custom Function's node turns into zeros
        where the unchecked run leaves None. (Inside an enclosing
        recomputation the edge goes to a fresh stand-in, which cannot.)"""
        uses_of: list[list[int]] = [[] for _ in record.tensors]
        for position in sorted(range(len(record.uses)), key=lambda j: -record.uses[j][0]):
            uses_of[record.uses[position][1]].append(position)
        self.use_targets = [target for _, target, _ in record.uses]
        self.use_edges = [0] * len(record.uses)
        edges: list[torch.Tensor] = []
        for target, tensor in enumerate(record.tensors):
            mine = []
            for position in uses_of[target]:
                self.use_edges[position] = len(edges)
                mine.append(len(edges))
                edges.append(record.uses[position][2])
            if not mine and (frames or target in record.read_targets):
                mine.append(len(edges))
                edges.append(_read(frames, tensor))
            self.edges_of.append(mine)
        self.targets = [(weakref.ref(tensor), version_of(tensor)) for tensor in record.tensors]
        return edges


def run_reentrant(function: Callable[..., Any], args: tuple[Any, ...], *, preserve_rng_state: bool, api: str) -> Any:
    """``function(*args)`` as a reentrant region; see the module docstring."""
    frames = _frames.get()
    if not frames:
        return _run(function, args, (), preserve_rng_state, api)
    # Inside an enclosing region (its forward or its recomputation) the frames
    # see the function's torch calls, not this region's own bookkeeping (which
    # reads its tensors: a view check, a detach of what it returns).
    token = _frames.set(())
    try:
        return _run(function, args, frames, preserve_rng_state, api)
    finally:
        _frames.reset(token)


def _run(
    function: Callable[..., Any], args: tuple[Any, ...], frames: tuple[_Frame, ...], preserve_rng_state: bool, api: str
) -> Any:
    if not torch.is_grad_enabled():  # nothing will be differentiated here
        if not frames:
            check_backward_validity(args)
        # Inside an enclosing region's forward, its recomputation will: there
        # this call is a region whose node has an edge to each tensor input,
        # used or not, so each one must be a target of the enclosing regions.
        for value in args:
            if isinstance(value, torch.Tensor):
                for frame in frames:
                    frame.touch(value)
        token = _frames.set(frames)
        try:
            return function(*args)
        finally:
            _frames.reset(token)
    state = _State(function, api, ReplayState.capture(tensor_leaves(args), preserve_rng=preserve_rng_state), args)
    record = _Record()
    tensors = [args[i] for i in state.positions]
    for tensor in tensors:
        target = record.touch(tensor, read=False)
        state.input_targets.append(-1 if target is None else target)
    try:
        with torch.no_grad(), _Active(record, frames):
            outputs = function(*args)
    except RuntimeError as exc:
        if _NO_GRAPH in str(exc):
            raise CheckpointError(_backward_inside_advice(api)) from exc
        raise
    state.replay.check_device_unchanged(api)
    _warn_on_nested_tensors(outputs, api)
    if not record.tensors:
        from remat._source import user_stacklevel  # a warning only: keep import remat lean

        warnings.warn(
            "None of the inputs have requires_grad=True, and the checkpointed function "
            "uses no tensor that does. Gradients will be None",
            stacklevel=user_stacklevel(),
        )
        return outputs
    edges = state.lay_out(record, frames)
    state.outputs = outputs
    results = _ReentrantNode.apply(state, tensors, *edges)  # type: ignore[no-untyped-call]
    # A tensor the function returns as it came in is returned itself, as
    # without checkpointing: its users then add their gradients to it directly.
    if isinstance(outputs, torch.Tensor):
        return outputs if _came_in(outputs, record, tensors) else results
    if isinstance(outputs, tuple):
        return tuple(
            output if isinstance(output, torch.Tensor) and _came_in(output, record, tensors) else result
            for output, result in zip(outputs, results, strict=True)
        )
    return results


def _came_in(output: torch.Tensor, record: _Record, inputs: list[torch.Tensor]) -> bool:
    return id(output) in record.index or any(output is tensor for tensor in inputs)


class _ReentrantNode(torch.autograd.Function):
    """The region's one node: ``apply(state, tensor inputs, *edges)``."""

    @staticmethod
    def forward(ctx: Any, state: _State, inputs: list[torch.Tensor], *edges: torch.Tensor) -> Any:
        ctx.state = state
        # The tensor inputs, as an enclosing region's saved tensors and under
        # autograd's in-place check (constants are not edges, saved all the same).
        ctx.save_for_backward(*inputs)
        # Outputs no backward reaches get None, not zeros: a nested backward from
        # zeros would leave zero gradients where an unchecked run leaves None.
        ctx.set_materialize_grads(False)
        outputs, state.outputs = state.outputs, None
        # Fresh tensors: an output may be an input or a closure returned as it is,
        # whose own history the node must not take over.
        if isinstance(outputs, torch.Tensor):
            return outputs.detach()
        if isinstance(outputs, tuple):
            return tuple(value.detach() if isinstance(value, torch.Tensor) else value for value in outputs)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> tuple[Any, ...]:
        state: _State = ctx.state
        if all(grad is None for grad in grad_outputs):  # nothing flows (a stopped path): as without checkpoint
            return (None, None, *(None for mine in state.edges_of for _ in mine))
        # The engine runs a node's backward with grad on only under
        # create_graph=True: a double backward (docs/design/reentrant.md).
        if not torch.is_grad_enabled():
            state.materialized = None
            return (None, None, *_differentiate(state, _recompute(state, ctx.saved_tensors, None), grad_outputs))
        # The gradients' history: through the recomputation the second backward
        # must go through, whole per target. Their values: use by use, exactly
        # as the first-order backward gives them.
        history, saved = _history(state, ctx, grad_outputs)
        plain = tuple(grad.detach() if isinstance(grad, torch.Tensor) else grad for grad in grad_outputs)
        values = _differentiate(state, _recompute(state, saved, None), plain)  # no history at all
        return (None, None, *_with_history(state, values, history))


def _history(
    state: _State, ctx: Any, grad_outputs: tuple[Any, ...]
) -> tuple[list[torch.Tensor | None], tuple[torch.Tensor, ...]]:
    """The edges' gradients with their history, for a double backward (and the
    node's saved tensors)."""
    done = _materialize(state, ctx, backward_key())
    return _differentiate(state, done, grad_outputs), done.saved


def _stop_here(grads: Any) -> tuple[None, ...]:
    return (None,) * len(grads)


def _differentiate(state: _State, done: _Recomputed, grad_outputs: tuple[Any, ...]) -> list[torch.Tensor | None]:
    """The gradient of each of the node's edges, by a nested ``autograd.grad``
    through the recomputation ``done`` (with its history when it has doors)."""
    higher = done.substitute.doors is not None
    pairs = [
        (output, grad)
        for output, grad in zip(done.outputs, grad_outputs, strict=False)
        if isinstance(output, torch.Tensor) and output.requires_grad
    ]
    if not pairs:
        raise CheckpointError(
            f"{state.api}(use_reentrant=True): none of the outputs requires grad, so "
            "there is nothing to backpropagate through this checkpoint. Make an input "
            "require grad, or do not checkpoint this function."
        )
    edges = sum(len(mine) for mine in state.edges_of)
    pairs = [(output, grad) for output, grad in pairs if grad is not None]
    if not pairs:  # no used output requires grad: nothing flows, as without checkpoint
        return [None] * edges
    roots = [output for output, _ in pairs]
    substitute = done.substitute
    standins = substitute.standins
    # Tensors standing for targets as they are: the recomputation's arguments
    # (or doors) and the inner regions' edges to targets they never used.
    whole = done.inputs + substitute.reads
    fresh = [tensor for _, tensor in whole] + [standin for _, _, standin in standins] + substitute.leaves
    direct, exits, feeds = _exits(state, roots, fresh, whole, done.sources, done.made)
    if exits:
        _check_exits(state.api, exits, higher)
    captured = whole + direct
    wrt: list[Any] = [standin for _, _, standin in standins] + [tensor for _, tensor in captured]
    wrt += [way for way, _, _ in exits]
    hooks = []
    arrivals = None
    if substitute.quiet and not higher:
        # Custom Functions took targets as they are: each one's gradient is
        # collected from its node, to be added where the unchecked run adds it.
        arrivals = _Arrivals(captured, feeds)
        hooks = [node.register_hook(functools.partial(arrivals.arrive, node)) for node in arrivals.nodes]
    ahead: list[torch.Tensor] = []
    if higher:
        # A leaf that is its own door may lie, outside the region, behind a
        # bridge or behind a target a custom Function took as it is: to reach
        # the leaf, the nested backward would go through that node and count
        # the path twice. Such a node's gradient is captured before it runs;
        # guarded, it then passes nothing on (the graph is kept: create_graph).
        doors = [door for door in substitute.doors if door is not None]  # type: ignore[union-attr]
        if any(door.grad_fn is None for door in doors):
            ahead = doors + [tensor for _, tensor in direct]
    elif len(direct) > 1:  # the same between two targets custom Functions took (the graph kept)
        ahead = [tensor for _, tensor in direct]
    hooks += [tensor.grad_fn.register_prehook(_stop_here) for tensor in ahead if tensor.grad_fn is not None]
    try:
        grads = torch.autograd.grad(
            roots, wrt, [grad for _, grad in pairs], allow_unused=True, create_graph=higher, retain_graph=bool(ahead) or higher
        )
    finally:
        for hook in hooks:
            hook.remove()
    found = len(standins) + len(captured)
    loose: list[tuple[int, torch.Tensor]] = []
    out = _edge_gradients(state, edges, standins, substitute.quiet, captured, grads[:found], arrivals, loose)
    for target, grad in loose:  # (rare: a custom Function took an input the forward never read)
        tensor = done.sources[target]
        assert tensor is not None, "remat bug: a gradient for an input that is gone"
        way = tensor if tensor.grad_fn is None else GradientEdge(tensor.grad_fn, tensor.output_nr)
        exits.append((way, f"an input of shape {tuple(tensor.shape)} ({tensor.dtype})", ""))
        _check_exits(state.api, exits[-1:], higher)
        grads += (grad,)
    for (way, _, _), grad in zip(exits, grads[found:], strict=True):
        if grad is not None:  # as torch's reentrant backward gives it (see _exits)
            accumulate_through(way, grad)
    return out


class _Arrivals:
    """The gradients the recomputed graph's nodes send to the tensors captured
    whole, node by node (a node hook): ``(node's sequence number, position in
    the captured list, gradient)``, in the order the nested backward runs them."""

    __slots__ = ("got", "nodes", "wanted")

    def __init__(self, captured: list[tuple[int, torch.Tensor]], feeds: list[tuple[Any, int, torch.Tensor]]) -> None:
        position = {id(tensor): index for index, (_, tensor) in enumerate(captured)}
        self.wanted: dict[Any, list[tuple[int, int]]] = {}  # node -> (edge, position)
        for node, edge, tensor in feeds:
            self.wanted.setdefault(node, []).append((edge, position[id(tensor)]))
        self.nodes = list(self.wanted)
        self.got: list[tuple[int, int, torch.Tensor]] = []

    def arrive(self, node: Any, grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
        number = node_sequence_nr(node)
        for edge, position in self.wanted[node]:
            grad = grad_inputs[edge]
            if grad is not None:
                self.got.append((number, position, grad))


def _with_history(
    state: _State, values: list[torch.Tensor | None], history: list[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """Each edge's exact value; a target's whole history on the last of its edges
    that has a value. Without checkpointing, every use of a target adds its
    gradient to that target's one gradient, so a second backward gives each
    use's gradient the same gradient: carried by one of them, the sum of
    their histories is the same sum."""
    out = list(values)
    for mine in state.edges_of:
        if not mine:
            continue
        whole = history[mine[-1]]
        if whole is None:
            continue
        carrier = next((edge for edge in reversed(mine) if values[edge] is not None), None)
        if carrier is None:
            out[mine[-1]] = whole
        else:
            out[carrier] = _Valued.apply(values[carrier], whole)  # type: ignore[no-untyped-call]
    return out


class _Valued(torch.autograd.Function):
    """``value`` with the history of ``history`` (same shape; a double backward's
    gradient: its value exact use by use, its history whole per target)."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        return value.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, grad


class _Recomputed:
    """One recomputation of a region: what its backward differentiates."""

    __slots__ = ("inputs", "made", "outputs", "saved", "sources", "substitute")

    def __init__(
        self,
        saved: tuple[torch.Tensor, ...],
        outputs: tuple[Any, ...],
        substitute: _Substitute,
        inputs: list[tuple[int, torch.Tensor]],
        sources: list[torch.Tensor | None],
        made: range,
    ) -> None:
        self.saved = saved  # the node's saved tensors, unpacked once (enclosing hooks hand them out once)
        self.outputs = outputs  # as a tuple, in the node's output order
        self.substitute = substitute
        self.inputs = inputs  # the arguments that stand for a target
        self.sources = sources  # per target, the tensor it is (None once gone)
        self.made = made  # the autograd nodes it made, by sequence number


def _recompute(state: _State, saved: tuple[torch.Tensor, ...], key: Hashable | None) -> _Recomputed:
    """Rerun the region's function with grad on, each use given a stand-in.

    ``key`` is the backward call of a double backward (None otherwise): the
    stand-ins then have gradient edges to the targets, and a target made by
    another reentrant region's node is taken from that region's recomputation
    for the same call (:func:`_materialize`).
    """
    args, index, inputs, sources, doors = _recompute_inputs(state, saved, key)
    substitute = _Substitute(index, doors)
    origin = next_sequence_nr()
    with state.replay.restore(), torch.enable_grad(), _Active(substitute):
        outputs = state.function(*args)
    made = range(origin, next_sequence_nr())
    for target, (ref, _) in enumerate(state.targets):
        tensor = ref()
        if tensor is not None:  # the recomputation may change a target as the forward did
            state.targets[target] = (ref, version_of(tensor))
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    return _Recomputed(saved, outputs, substitute, inputs, sources, made)


def _materialize(state: _State, ctx: Any, key: Hashable | None) -> _Recomputed:
    """The region's recomputation for a double backward's call ``key``, made
    after those of the reentrant regions whose outputs it reads.

    Without checkpointing, the second backward goes through one graph per
    region, which both the region's own second-order terms and those of the
    regions after it reach. Here that graph is the recomputation: a region's
    stand-in for a tensor another reentrant region returned has its edge to
    that region's recomputed output, not to its node, so the producer is
    recomputed first (its own backward, later in the same call, takes it).
    Producers before consumers, without recursion: a chain of regions may be
    long.
    """
    kept = state.materialized
    state.materialized = None
    if kept is not None and kept[0] == key:
        return kept[1]
    saved = ctx.saved_tensors
    order: list[tuple[_State, tuple[torch.Tensor, ...]]] = []
    pending: list[tuple[_State, tuple[torch.Tensor, ...], bool]] = [(state, saved, False)]
    queued = {id(state)}
    while pending:
        region, tensors, ready = pending.pop()
        if ready:
            order.append((region, tensors))
            continue
        pending.append((region, tensors, True))
        for producer in _producers(region, tensors):
            other: _State = producer.state
            if id(other) in queued or (other.materialized is not None and other.materialized[0] == key):
                continue
            queued.add(id(other))
            pending.append((other, producer.saved_tensors, False))
    for region, tensors in order[:-1]:
        region.materialized = (key, _recompute(region, tensors, key))
    return _recompute(state, saved, key)


def _producers(state: _State, saved: tuple[torch.Tensor, ...]) -> list[Any]:
    """The reentrant nodes that made the region's inputs and what it read."""
    tensors = list(saved) + [tensor for tensor in (ref() for ref, _ in state.targets) if tensor is not None]
    nodes = []
    for tensor in tensors:
        node = tensor.grad_fn
        if node is not None and isinstance(getattr(node, "state", None), _State):
            nodes.append(node)
    return nodes


def _bridged(tensor: torch.Tensor, key: Hashable | None) -> torch.Tensor:
    """``tensor``, or its recomputation for ``key`` when a reentrant region made it."""
    node = tensor.grad_fn
    producer = getattr(node, "state", None) if node is not None else None
    if isinstance(producer, _State) and producer.materialized is not None and producer.materialized[0] == key:
        recomputed = producer.materialized[1].outputs[tensor.output_nr]
        # (An output the recomputation made without grad has no history to follow.)
        if isinstance(recomputed, torch.Tensor) and recomputed.requires_grad:
            return recomputed
    return tensor


class _StandIn(torch.autograd.Function):
    """A stand-in with a gradient edge to the tensor it stands for (double backward).

    The first backward stops at it all the same (it is one of the tensors the
    nested ``autograd.grad`` differentiates with respect to, and nothing that
    backward needs lies behind it), but the gradient it returns is recorded
    with ``create_graph=True``: the second backward goes through the
    recomputed graph, then through this node, to the target.
    """

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        return tensor.detach()  # shares the data and the version counter

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> torch.Tensor | None:
        return grad


def _recompute_inputs(
    state: _State, saved: tuple[torch.Tensor, ...], key: Hashable | None
) -> tuple[
    list[Any], dict[int, int], list[tuple[int, torch.Tensor]], list[torch.Tensor | None], list[torch.Tensor | None] | None
]:
    """The recomputation's arguments, the target of each tensor it may use,
    the tensors that stand for a target as a whole (their gradients are
    captured whole: uses no stand-in caught), per target the tensor it is (the
    saved input, or what the function read; None once gone), and per target
    the tensor all its uses get instead of stand-ins (a *door*), or None.

    Under a double backward (``key``) every target gets a door: the target
    itself when it is a leaf (the recomputed graph then ends at it as the
    unchecked graph does, and a leaf has nothing behind it that the nested
    backward could walk into), else a :class:`_StandIn` of it. A tensor
    another reentrant region made is taken from that region's recomputation
    (:func:`_bridged`).
    """
    higher = key is not None
    args = list(state.args)
    index: dict[int, int] = {}  # by id() of tensors kept alive in args, doors and sources
    whole: list[tuple[int, torch.Tensor]] = []
    sources: list[torch.Tensor | None] = [None] * len(state.targets)
    doors: list[torch.Tensor | None] = [None] * len(state.targets)
    for position, tensor, target in zip(state.positions, saved, state.input_targets, strict=True):
        if target < 0:
            args[position] = tensor.detach()
            continue
        if higher:
            tensor = _bridged(tensor, key)
            value = doors[target] = _door(tensor, state.targets[target][0]())
        else:
            value = tensor.detach()
            value.requires_grad_(True)
            whole.append((target, value))
        index[id(value)] = target
        sources[target] = tensor
        args[position] = value
    for target, (ref, version) in enumerate(state.targets):
        read = ref()
        if read is None:
            continue
        if version_of(read) != version:
            raise CheckpointError(
                f"{state.api}(use_reentrant=True): a tensor the checkpointed function used "
                f"({tuple(read.shape)}, {read.dtype}) was modified by an inplace operation "
                f"after the forward (version {version}, now {version_of(read)}). The "
                "recomputation in backward would read the new values and compute wrong "
                "gradients. Typical cause: an optimizer step between the forward and "
                "backward; run backward first, or update a copy instead."
            )
        index.setdefault(id(read), target)
        if sources[target] is None:
            sources[target] = _bridged(read, key) if higher else read
        if higher and doors[target] is None and read.requires_grad:
            door = doors[target] = _door(sources[target], read)  # type: ignore[arg-type]
            index[id(door)] = target
    if not higher:
        return args, index, whole, sources, None
    whole = [(target, door) for target, door in enumerate(doors) if door is not None]
    return args, index, whole, sources, doors


def _door(source: torch.Tensor, read: torch.Tensor | None) -> torch.Tensor:
    """The tensor every use of a target gets in a double backward's recomputation:
    the leaf itself (the forward's object: a saved leaf unpacked through an
    enclosing region's hooks is another object with the same accumulator),
    else a bridge to it."""
    if read is not None and read.requires_grad and read.grad_fn is None:
        return read
    if not source.requires_grad:  # nothing behind it: a leaf of its own
        return source.detach().requires_grad_(True)
    return _StandIn.apply(source)  # type: ignore[no-untyped-call, no-any-return]


# A way out of the recomputed graph that no stand-in covers: the leaf or the
# gradient edge, what it is (for messages), and the node that leads to it.
_Exit = tuple[Any, str, str]


def _exits(
    state: _State,
    roots: list[torch.Tensor],
    fresh: list[torch.Tensor],
    whole: list[tuple[int, torch.Tensor]],
    sources: list[torch.Tensor | None],
    made: range,
) -> tuple[list[tuple[int, torch.Tensor]], list[_Exit], list[tuple[Any, int, torch.Tensor]]]:
    """Where the recomputed graph leaves the region other than through a
    ``fresh`` tensor (a stand-in, an argument, a leaf the region made), and
    which nodes feed the tensors captured whole.

    Every use the forward saw went to a stand-in. What is left is a custom
    ``autograd.Function``'s edge, which the mode does not see: to a target
    (the forward read it: a property, an op in the Function's own forward),
    whose gradient is then captured whole (*direct*); or to a tensor the
    forward never read in Python (a C++ extension's weight), an *exit*,
    which the region's node has no edge to. The *feeds* are the edges
    ``(node, edge index, tensor)`` into ``whole`` tensors and direct targets.
    """
    wanted = {id(tensor) for _, tensor in whole}  # kept alive by ``whole``
    known = {id(tensor) for tensor in fresh if tensor.grad_fn is None}  # kept alive by ``fresh``
    ends: dict[tuple[Any, int], tuple[int, torch.Tensor]] = {
        (tensor.grad_fn, tensor.output_nr): (-1, tensor) for tensor in fresh if tensor.grad_fn is not None
    }
    leaves: dict[int, int] = {}  # id() of a leaf target (alive in ``targets``) -> target
    # A target as the recomputation reads it, and as it is (a double backward
    # reads another reentrant region's output from that region's recomputation).
    targets = [(target, tensor) for target, tensor in enumerate(sources) if tensor is not None]
    targets += [(target, tensor) for target, (ref, _) in enumerate(state.targets) if (tensor := ref()) is not None]
    for target, tensor in targets:
        if tensor.requires_grad:
            if tensor.grad_fn is None:
                leaves.setdefault(id(tensor), target)
            else:
                ends.setdefault((tensor.grad_fn, tensor.output_nr), (target, tensor))
    direct: dict[int, tuple[int, torch.Tensor]] = {}  # by id() of the tensor (kept alive there)
    exits: list[_Exit] = []
    feeds: list[tuple[Any, int, torch.Tensor]] = []
    left: set[tuple[Any, int]] = set()
    seen: set[Any] = set()
    budget = len(made)  # the recomputation made no more nodes than this
    stack: list[tuple[Any, int, Any, int]] = [
        (root.grad_fn, root.output_nr, None, 0) for root in roots if root.grad_fn is not None
    ]
    while stack:
        node, number, parent, edge = stack.pop()
        end = ends.get((node, number))
        if end is not None:
            target, tensor = end
            if target >= 0:
                direct[id(tensor)] = (target, tensor)
            if parent is not None and (target >= 0 or id(tensor) in wanted):
                feeds.append((parent, edge, tensor))
            continue
        if node in seen:
            continue
        if node_sequence_nr(node) not in made:
            if (node, number) not in left:
                left.add((node, number))
                exits.append((GradientEdge(node, number), f"a tensor made outside the region by {node.name()}", parent.name()))
            continue
        if budget == 0:
            raise CheckpointError(
                f"{state.api}(use_reentrant=True): the recomputed graph could not be told from the "
                "graph outside the region (were autograd nodes made on another thread while it "
                "ran?). Use use_reentrant=False."
            )
        seen.add(node)
        budget -= 1
        for index, (nxt, nxt_number) in enumerate(node.next_functions):
            if nxt is None:
                continue
            if isinstance(nxt, AccumulateGrad):
                leaf: torch.Tensor = nxt.variable  # type: ignore[attr-defined]
                key = id(leaf)
                if key in wanted:
                    feeds.append((node, index, leaf))
                elif key not in known:
                    found = leaves.get(key)
                    if found is not None:
                        direct[key] = (found, leaf)
                        feeds.append((node, index, leaf))
                    else:
                        known.add(key)
                        exits.append((leaf, f"a leaf tensor of shape {tuple(leaf.shape)} ({leaf.dtype})", node.name()))
                continue
            if nxt not in seen or (nxt, nxt_number) in ends:
                stack.append((nxt, nxt_number, node, index))
    return sorted(direct.values(), key=lambda item: item[0]), exits, feeds


def _check_exits(api: str, exits: list[_Exit], higher: bool) -> None:
    """Raise where an exit's gradient cannot be given as torch's reentrant backward
    gives it (a nested backward of its own, ``.backward()`` only)."""
    fix = (
        "Pass that tensor to the checkpointed function as an argument (the region then has "
        "an edge to it), or use use_reentrant=False."
    )
    _, what, via = exits[0]
    via = f" {via}" if via else ""
    if higher:
        raise CheckpointError(
            f"{api}(use_reentrant=True), double backward: the custom autograd.Function{via} in "
            f"the recomputed function takes {what}, which the forward never read in Python, so "
            "the region's node has no edge to it, and a nested backward of its own (as torch's "
            f"reentrant variant gives first-order gradients) would record no second-order terms. {fix}"
        )
    if not is_checkpoint_valid():
        raise CheckpointError(
            f"{api}(use_reentrant=True): the custom autograd.Function{via} in the recomputed "
            f"function takes {what}, which the forward never read in Python, so the region's "
            "node has no edge to it. Its gradient can only reach it by a nested backward of "
            "its own, as torch's reentrant variant gives it, and that runs only under a plain "
            ".backward() of a region that is not nested in another reentrant region (here: "
            f"torch.autograd.grad, backward(inputs=...), or an enclosing region's backward). {fix}"
        )
    for way, what, name in exits:
        if not isinstance(way, torch.Tensor) and not backward_from_edges_supported():
            via = f" {name}" if name else ""
            raise CheckpointError(
                f"{api}(use_reentrant=True): the custom autograd.Function{via} in the recomputed "
                f"function takes {what}, which the forward never read in Python; a nested "
                f"backward from it needs torch >= 2.7 (this is {torch.__version__}). {fix}"
            )


def _edge_gradients(
    state: _State,
    edges: int,
    standins: list[tuple[int, int, torch.Tensor]],
    quiet: list[tuple[int, int]],
    captures: list[tuple[int, torch.Tensor]],
    grads: tuple[torch.Tensor | None, ...],
    arrivals: _Arrivals | None,
    loose: list[tuple[int, torch.Tensor]],
) -> list[torch.Tensor | None]:
    """One gradient per edge of the node (see :meth:`_State.lay_out`); whole
    gradients of targets with no edge go to ``loose``."""
    out: list[torch.Tensor | None] = [None] * edges

    def add(edge: int, grad: torch.Tensor) -> None:
        current = out[edge]
        out[edge] = grad if current is None else current + grad

    last = [mine[-1] if mine else -1 for mine in state.edges_of]  # per target, the edge a whole gradient goes to
    inside: dict[tuple[int, int], int] = {}  # (target, number after a custom Function's node) -> edge
    if [target for _, target, _ in standins] == state.use_targets:
        # The recomputation used the targets as the forward did: use by use.
        for edge, grad in zip(state.use_edges, grads, strict=False):
            if grad is not None:
                add(edge, grad)
        # A use made with grad off was inside a custom Function's forward: the
        # Function's node took the target itself, and its gradient belongs to
        # that use, where the unchecked run adds it.
        for position, number in quiet:
            target = standins[position][1]
            last[target] = inside[target, number] = state.use_edges[position]
    else:
        # It did not (a leaf made inside the region, another control flow):
        # each target's gradients fill its edges in order, the rest added to the last.
        filled = [0] * len(state.edges_of)
        for position in sorted(range(len(standins)), key=lambda j: -standins[j][0]):
            grad = grads[position]
            if grad is not None:
                target = standins[position][1]
                mine = state.edges_of[target]
                add(mine[min(filled[target], len(mine) - 1)], grad)
                filled[target] += 1
    if arrivals is not None:  # node by node: a custom Function's to the use inside its forward
        got = [(captures[position][0], number, grad) for number, position, grad in arrivals.got]
    else:  # a use no stand-in caught (a custom Function's input)
        got = [(target, -2, grad) for (target, _), grad in zip(captures, grads[len(standins) :], strict=True) if grad is not None]
    for target, number, grad in got:
        edge = inside.get((target, number + 1), last[target])
        if edge < 0:
            loose.append((target, grad))  # an input the forward never read: no edge
        else:
            add(edge, grad)
    return out
