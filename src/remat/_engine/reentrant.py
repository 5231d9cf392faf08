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

Documented limits, each an error or a warning naming ``use_reentrant=False``:
double backward (the nested backward records no second-order terms),
autograd called inside the function (its forward runs under ``no_grad``),
keyword arguments, and tensors returned inside containers (``autograd.Function``
connects only top-level tensors to the graph).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from remat._compat import (
    AccumulateGrad,
    is_checkpoint_valid,
    is_edgeless_view,
    next_sequence_nr,
    node_sequence_nr,
    version_of,
)
from remat._engine.replay import ReplayState, tensor_leaves
from remat.errors import CheckpointError

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
        raise TypeError(
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

    __slots__ = ("call", "index", "tensors", "uses")

    def __init__(self) -> None:
        self.index: dict[int, int] = {}  # id() of a tensor in ``tensors`` (kept alive there)
        self.tensors: list[torch.Tensor] = []
        self.uses: list[tuple[int, int, torch.Tensor]] = []  # (call, target, tensor received)
        self.call = 0

    def target(self, tensor: torch.Tensor) -> int:
        """The index of ``tensor`` among the region's targets (added if new)."""
        known = self.index.get(id(tensor))
        if known is None:
            known = self.index[id(tensor)] = len(self.tensors)
            self.tensors.append(tensor)
        return known

    def touch(self, tensor: torch.Tensor) -> int | None:
        """A tensor the forward reads (a property, a use): its target, if it is one."""
        known = self.index.get(id(tensor))
        if known is None and tensor.requires_grad and not is_edgeless_view(tensor):
            known = self.target(tensor)
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

    __slots__ = ("call", "index", "leaves", "reads", "standins")

    def __init__(self, index: dict[int, int]) -> None:
        # id() of each tensor that stands for a target; the backward keeps
        # them alive (arguments, captures), the stand-ins live in ``standins``.
        self.index = index
        self.call = 0
        self.standins: list[tuple[int, int, torch.Tensor]] = []  # (call, target, stand-in)
        self.reads: list[tuple[int, torch.Tensor]] = []  # (target, stand-in) of an inner region's edge
        self.leaves: list[torch.Tensor] = []  # leaves that require grad, made by the region

    def touch(self, tensor: torch.Tensor) -> int | None:
        return None

    def see(self, original: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        target = self.index.get(id(original))
        if target is None:
            return current
        standin = current.detach()
        standin.requires_grad_(True)
        self.standins.append((self.call, target, standin))
        # An op may hand its argument back (remat.name, in-place ops): where
        # the forward then used the target again, this is used again.
        self.index[id(standin)] = target
        return standin

    def read(self, original: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        """A stand-in for an edge of a region nested in this recomputation that
        goes to a target with no use of its own (an input the inner function
        never used): its gradient reaches the target whole, as a capture does."""
        target = self.index.get(id(original))
        if target is None:
            return current
        standin = current.detach()
        standin.requires_grad_(True)
        self.reads.append((target, standin))
        return standin

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
    first): inside an enclosing recomputation, a stand-in of its own."""
    if not frames:
        return tensor
    token = _frames.set(())  # making a stand-in is no use the frames should see
    try:
        current = tensor
        for frame in frames:
            current = frame.read(tensor, current)
    finally:
        _frames.reset(token)
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
    """Push a frame for the block (and the mode, if it is the first frame)."""

    __slots__ = ("frame", "mode", "token")

    def __init__(self, frame: _Frame) -> None:
        self.frame = frame
        self.mode: _UsesMode | None = None
        self.token: Any = None

    def __enter__(self) -> None:
        frames = _frames.get()
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

    def lay_out(self, record: _Record) -> list[torch.Tensor]:
        """The node's edges: per target one per use, latest call first (the order
        in which autograd adds the uses' gradients without checkpointing; a
        call's arguments in order), or one for a target the forward only read
        (a custom autograd.Function's input)."""
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
            if not mine:
                mine.append(len(edges))
                edges.append(_read(_frames.get(), tensor))
            self.edges_of.append(mine)
        self.targets = [(weakref.ref(tensor), version_of(tensor)) for tensor in record.tensors]
        return edges


def run_reentrant(function: Callable[..., Any], args: tuple[Any, ...], *, preserve_rng_state: bool, api: str) -> Any:
    """``function(*args)`` as a reentrant region; see the module docstring."""
    if not torch.is_grad_enabled():  # nothing will be differentiated here
        frames = _frames.get()
        if not frames:
            check_backward_validity(args)
        # Inside an enclosing region's forward, its recomputation will: there
        # this call is a region whose node has an edge to each tensor input,
        # used or not, so each one must be a target of the enclosing regions.
        for value in args:
            if isinstance(value, torch.Tensor):
                for frame in frames:
                    frame.touch(value)
        return function(*args)
    state = _State(function, api, ReplayState.capture(tensor_leaves(args), preserve_rng=preserve_rng_state), args)
    record = _Record()
    tensors = [args[i] for i in state.positions]
    for tensor in tensors:
        target = record.touch(tensor)
        state.input_targets.append(-1 if target is None else target)
    try:
        with torch.no_grad(), _Active(record):
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
    edges = state.lay_out(record)
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
        if torch.is_grad_enabled():  # the engine enables grad only under create_graph=True
            raise CheckpointError(
                f"{state.api}(use_reentrant=True) does not support double backward "
                "(backward or autograd.grad with create_graph=True): its nested backward "
                "cannot record the region's second-order terms, so the gradient of the "
                "gradient would be silently wrong. Pass use_reentrant=False (recommended), "
                "which supports it."
            )
        args, index, captures = _recompute_inputs(state, ctx.saved_tensors)
        substitute = _Substitute(index)
        origin = next_sequence_nr()
        with state.replay.restore(), torch.enable_grad(), _Active(substitute):
            outputs = state.function(*args)
        made = range(origin, next_sequence_nr())
        for target, (ref, _) in enumerate(state.targets):
            tensor = ref()
            if tensor is not None:  # the recomputation may change a target as the forward did
                state.targets[target] = (ref, version_of(tensor))
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [
            (output, grad)
            for output, grad in zip(outputs, grad_outputs, strict=False)
            if isinstance(output, torch.Tensor) and output.requires_grad
        ]
        if not pairs:
            raise RuntimeError(
                f"{state.api}(use_reentrant=True): none of the outputs requires grad, so "
                "there is nothing to backpropagate through this checkpoint. Make an input "
                "require grad, or do not checkpoint this function."
            )
        edges = sum(len(mine) for mine in state.edges_of)
        pairs = [(output, grad) for output, grad in pairs if grad is not None]
        if not pairs:  # no used output requires grad: nothing flows, as without checkpoint
            return (None, None, *(None for _ in range(edges)))
        roots = [output for output, _ in pairs]
        standins = substitute.standins
        captured = [(target, tensor) for target, tensor in captures if tensor.requires_grad]
        captured += substitute.reads  # edges of inner regions, taken whole as captures are
        strays = _strays(state.api, roots, substitute, captured, made)
        wrt = [standin for _, _, standin in standins] + [tensor for _, tensor in captured] + strays
        grads = torch.autograd.grad(roots, wrt, [grad for _, grad in pairs], allow_unused=True)
        found = len(standins) + len(captured)
        for leaf, grad in zip(strays, grads[found:], strict=True):
            if grad is not None:  # as torch's reentrant backward does (see _strays)
                torch.autograd.backward([leaf], [grad])
        return (None, None, *_edge_gradients(state, edges, standins, captured, grads[:found]))


def _recompute_inputs(
    state: _State, saved: tuple[torch.Tensor, ...]
) -> tuple[list[Any], dict[int, int], list[tuple[int, torch.Tensor]]]:
    """The recomputation's arguments, the target of each tensor it may use, and
    the tensors standing for each target as they are (their gradients, where
    they require grad, are captured whole: uses no stand-in caught)."""
    args = list(state.args)
    index: dict[int, int] = {}  # by id() of tensors kept alive in args and captures
    captures: list[tuple[int, torch.Tensor]] = []
    for position, tensor, target in zip(state.positions, saved, state.input_targets, strict=True):
        value = tensor.detach()
        if target >= 0:
            value.requires_grad_(True)
            index[id(value)] = target
            captures.append((target, value))
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
        captures.append((target, read))
    return args, index, captures


def _strays(
    api: str,
    roots: list[torch.Tensor],
    substitute: _Substitute,
    captures: list[tuple[int, torch.Tensor]],
    made: range,
) -> list[torch.Tensor]:
    """Leaves outside the region that the recomputed graph reaches by an edge
    the region's node does not have; raise if such an edge leads elsewhere.

    Every use the forward saw went to a stand-in or a captured target. What
    is left is a custom ``autograd.Function`` handed a tensor the forward
    never read in Python (a C++ extension's weight). A leaf gets its gradient
    as torch's reentrant backward gives it, accumulated by a nested backward
    of its own (``.backward()`` only); anything else would be lost.
    """
    # id() of leaves kept alive by the substitute frame and the captures.
    known = {id(standin) for _, _, standin in substitute.standins}
    known.update(id(tensor) for _, tensor in captures if tensor.grad_fn is None)
    known.update(id(leaf) for leaf in substitute.leaves)
    ends = {(tensor.grad_fn, tensor.output_nr) for _, tensor in captures if tensor.grad_fn is not None}
    strays: list[torch.Tensor] = []
    budget = len(made)  # the recomputation made no more nodes than this
    seen: set[Any] = set()
    stack = [(root.grad_fn, root.output_nr) for root in roots if root.grad_fn is not None]
    while stack:
        node, number = stack.pop()
        if node in seen:
            continue
        if (node, number) in ends:
            continue
        if node_sequence_nr(node) not in made or budget == 0:
            raise CheckpointError(
                f"{api}(use_reentrant=True): the recomputed function hands a tensor with history "
                "outside the region to a custom autograd.Function without reading it in Python "
                "in the forward, so its gradient cannot leave the region. Pass that tensor to "
                "the checkpointed function as an argument, or use use_reentrant=False."
            )
        seen.add(node)
        budget -= 1
        for nxt, number in node.next_functions:
            if nxt is None or nxt in seen:
                continue
            if isinstance(nxt, AccumulateGrad):
                variable: torch.Tensor = nxt.variable  # type: ignore[attr-defined]
                if id(variable) not in known:
                    known.add(id(variable))
                    strays.append(variable)
                continue
            stack.append((nxt, number))
    if strays and not is_checkpoint_valid():
        raise RuntimeError(
            f"{api}(use_reentrant=True): the recomputed function hands a tensor it did not "
            "read in Python in the forward to a custom autograd.Function; its gradient can only "
            "be accumulated by a nested backward, which does not work with "
            "torch.autograd.grad() or with backward(inputs=...). Pass that tensor to the "
            "checkpointed function as an argument, or use use_reentrant=False (recommended)."
        )
    return strays


def _edge_gradients(
    state: _State,
    edges: int,
    standins: list[tuple[int, int, torch.Tensor]],
    captures: list[tuple[int, torch.Tensor]],
    grads: tuple[torch.Tensor | None, ...],
) -> list[torch.Tensor | None]:
    """One gradient per edge of the node (see :meth:`_State.lay_out`)."""
    out: list[torch.Tensor | None] = [None] * edges

    def add(edge: int, grad: torch.Tensor) -> None:
        current = out[edge]
        out[edge] = grad if current is None else current + grad

    if [target for _, target, _ in standins] == state.use_targets:
        # The recomputation used the targets as the forward did: use by use.
        for edge, grad in zip(state.use_edges, grads, strict=False):
            if grad is not None:
                add(edge, grad)
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
    for (target, _), grad in zip(captures, grads[len(standins) :], strict=True):
        if grad is not None:  # a use no stand-in caught (a custom Function's input)
            add(state.edges_of[target][-1], grad)
    return out
