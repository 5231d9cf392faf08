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

The frames and the node's edges are in ``reentrant_uses``, the sorting of the
nested backward's gradients onto the edges in ``reentrant_edges``.

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
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from remat._compat.autograd import (
    accumulate_through,
    backward_key,
    get_exec_group,
    next_sequence_nr,
    on_backward_end,
    version_of,
)
from remat._engine.forward_state import ReplayState, region_transform, tensor_leaves
from remat._engine.reentrant_edges import Arrivals, check_exits, edge_gradients, find_exits
from remat._engine.reentrant_uses import (
    Active,
    Frame,
    Recomputed,
    Record,
    RegionState,
    Substitute,
    active_frames,
)
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


def run_reentrant(function: Callable[..., Any], args: tuple[Any, ...], *, preserve_rng_state: bool, api: str) -> Any:
    """``function(*args)`` as a reentrant region; see the module docstring."""
    frames = active_frames.get()
    if not frames:
        return _run(function, args, (), preserve_rng_state, api)
    # Inside an enclosing region (its forward or its recomputation) the frames
    # see the function's torch calls, not this region's own bookkeeping (which
    # reads its tensors: a view check, a detach of what it returns).
    token = active_frames.set(())
    try:
        return _run(function, args, frames, preserve_rng_state, api)
    finally:
        active_frames.reset(token)


def _run(
    function: Callable[..., Any], args: tuple[Any, ...], frames: tuple[Frame, ...], preserve_rng_state: bool, api: str
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
        token = active_frames.set(frames)
        try:
            return function(*args)
        finally:
            active_frames.reset(token)
    state = RegionState(function, api, ReplayState.capture(tensor_leaves(args), preserve_rng=preserve_rng_state), args)
    record = Record()
    tensors = [args[i] for i in state.positions]
    for tensor in tensors:
        target = record.touch(tensor, read=False)
        state.input_targets.append(-1 if target is None else target)
    try:
        with torch.no_grad(), Active(record, frames):
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
    region_transform(api, reentrant=True)  # the node cannot run under torch.func (refused there)
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


def _came_in(output: torch.Tensor, record: Record, inputs: list[torch.Tensor]) -> bool:
    return id(output) in record.index or any(output is tensor for tensor in inputs)


class _ReentrantNode(torch.autograd.Function):
    """The region's one node: ``apply(state, tensor inputs, *edges)``."""

    @staticmethod
    def forward(ctx: Any, state: RegionState, inputs: list[torch.Tensor], *edges: torch.Tensor) -> Any:
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
            # A tensor returned twice stays one tensor (autograd then gives it
            # the last position's edge): its users' gradients are summed into
            # one, in the order the unchecked run sums them, not per position.
            fresh: dict[int, torch.Tensor] = {}
            for value in outputs:
                if isinstance(value, torch.Tensor) and id(value) not in fresh:
                    fresh[id(value)] = value.detach()
            return tuple(fresh[id(value)] if isinstance(value, torch.Tensor) else value for value in outputs)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> tuple[Any, ...]:
        state: RegionState = ctx.state
        if all(grad is None for grad in grad_outputs):  # nothing flows (a stopped path): as without checkpoint
            return (None, None, *(None for mine in state.edges_of for _ in mine))
        # The engine runs a node's backward with grad on only under
        # create_graph=True: a double backward (docs/design/reentrant.md).
        if not torch.is_grad_enabled():
            state.materialized.clear()
            return (None, None, *_differentiate(state, _recompute(state, ctx.saved_tensors, None), grad_outputs))
        # The gradients' history: through the recomputation the second backward
        # must go through, whole per target. Their values: use by use, exactly
        # as the first-order backward gives them.
        history, saved = _history(state, ctx, grad_outputs)
        plain = tuple(grad.detach() if isinstance(grad, torch.Tensor) else grad for grad in grad_outputs)
        values = _differentiate(state, _recompute(state, saved, None), plain)  # no history at all
        return (None, None, *_with_history(state, values, history))


def _history(
    state: RegionState, ctx: Any, grad_outputs: tuple[Any, ...]
) -> tuple[list[torch.Tensor | None], tuple[torch.Tensor, ...]]:
    """The edges' gradients with their history, for a double backward (and the
    node's saved tensors)."""
    done = _materialize(state, ctx, backward_key())
    return _differentiate(state, done, grad_outputs), done.saved


def _stop_here(grads: Any) -> tuple[None, ...]:
    return (None,) * len(grads)


def _differentiate(state: RegionState, done: Recomputed, grad_outputs: tuple[Any, ...]) -> list[torch.Tensor | None]:
    """The gradient of each of the node's edges, by a nested ``autograd.grad``
    through the recomputation ``done`` (with its history when it has doors)."""
    higher = done.substitute.doors is not None
    pairs = [
        (output, grad)
        for output, grad in zip(done.outputs, grad_outputs, strict=False)
        if isinstance(output, torch.Tensor) and output.requires_grad
    ]
    edges = sum(len(mine) for mine in state.edges_of)
    if not pairs and (state.reads_no_target or len(done.made) > 0):
        # The node's outputs require grad (every target has an edge: see
        # RegionState.lay_out), the function's do not: it read nothing that
        # requires grad, or what it made from such tensors it did not return.
        # Nothing flows, as without checkpoint. (Only a function that read such
        # tensors and made no graph at all cut its own gradient, with detach()
        # or no_grad: that is refused, as torch refuses it.)
        return [None] * edges
    if not pairs:
        raise CheckpointError(
            f"{state.api}(use_reentrant=True): none of the outputs requires grad, so "
            "there is nothing to backpropagate through this checkpoint. Make an input "
            "require grad, or do not checkpoint this function."
        )
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
    direct, exits, feeds = find_exits(state, roots, fresh, whole, done.sources, done.made)
    if exits:
        check_exits(state.api, exits, higher)
    captured = whole + direct
    wrt: list[Any] = [standin for _, _, standin in standins] + [tensor for _, tensor in captured]
    wrt += [way for way, _, _ in exits]
    hooks = []
    arrivals = None
    if substitute.quiet and not higher:
        # Custom Functions took targets as they are: each one's gradient is
        # collected from its node, to be added where the unchecked run adds it.
        arrivals = Arrivals(captured, feeds)
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
    out = edge_gradients(state, edges, standins, substitute.quiet, captured, grads[:found], arrivals, loose)
    for target, grad in loose:  # (rare: a custom Function took an input the forward never read)
        tensor = done.sources[target]
        assert tensor is not None, "remat bug: a gradient for an input that is gone"
        way = tensor if tensor.grad_fn is None else GradientEdge(tensor.grad_fn, tensor.output_nr)
        exits.append((way, f"an input of shape {tuple(tensor.shape)} ({tensor.dtype})", ""))
        check_exits(state.api, exits[-1:], higher)
        grads += (grad,)
    for (way, _, _), grad in zip(exits, grads[found:], strict=True):
        if grad is not None:  # as torch's reentrant backward gives it (see find_exits)
            accumulate_through(way, grad)
    return out


def _with_history(
    state: RegionState, values: list[torch.Tensor | None], history: list[torch.Tensor | None]
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


def _recompute(state: RegionState, saved: tuple[torch.Tensor, ...], key: Hashable | None) -> Recomputed:
    """Rerun the region's function with grad on, each use given a stand-in.

    ``key`` is the backward call of a double backward (None otherwise): the
    stand-ins then have gradient edges to the targets, and a target made by
    another reentrant region's node is taken from that region's recomputation
    for the same call (:func:`_materialize`).
    """
    args, index, inputs, sources, doors = _recompute_inputs(state, saved, key)
    substitute = Substitute(index, doors)
    origin = next_sequence_nr()
    with state.replay.restore(), torch.enable_grad(), Active(substitute):
        outputs = state.function(*args)
    made = range(origin, next_sequence_nr())
    for target, (ref, _) in enumerate(state.targets):
        tensor = ref()
        if tensor is not None:  # the recomputation may change a target as the forward did
            state.targets[target] = (ref, version_of(tensor))
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    return Recomputed(saved, outputs, substitute, inputs, sources, made)


def _materialize(state: RegionState, ctx: Any, key: Hashable | None) -> Recomputed:
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

    Kept per backward call: a consumer's nested backward (an enclosing
    region's ``autograd.grad``) is another call, whose regions may need the
    same producer while the producer's own backward, in the outer call, has
    yet to take the outer call's recomputation. One recomputation kept per
    region would be replaced by the inner call's, and the producer would
    then unpack its saved tensors twice in the outer call: an error inside a
    non-reentrant region, whose recomputed tensors are handed out once.
    """
    kept = state.materialized.pop(key, None)
    if kept is not None:
        return kept
    saved = ctx.saved_tensors
    order: list[tuple[RegionState, tuple[torch.Tensor, ...]]] = []
    pending: list[tuple[RegionState, tuple[torch.Tensor, ...], bool]] = [(state, saved, False)]
    queued = {id(state)}
    while pending:
        region, tensors, ready = pending.pop()
        if ready:
            order.append((region, tensors))
            continue
        pending.append((region, tensors, True))
        for producer in _producers(region, tensors):
            other: RegionState = producer.state
            if id(other) in queued or key in other.materialized:
                continue
            queued.add(id(other))
            pending.append((other, producer.saved_tensors, False))
    # Not taken in this call (its backward does not run there, as in a nested
    # one): dropped when the call ends; a group's serves its later calls.
    ends = get_exec_group() is None
    for region, tensors in order[:-1]:
        region.materialized[key] = _recompute(region, tensors, key)
        if ends:
            on_backward_end(functools.partial(_forget, region, key))
    return _recompute(state, saved, key)


def _forget(state: RegionState, key: Hashable | None) -> None:
    state.materialized.pop(key, None)


def _producers(state: RegionState, saved: tuple[torch.Tensor, ...]) -> list[Any]:
    """The reentrant nodes that made the region's inputs and what it read."""
    tensors = list(saved) + [tensor for tensor in (ref() for ref, _ in state.targets) if tensor is not None]
    nodes = []
    for tensor in tensors:
        node = tensor.grad_fn
        if node is not None and isinstance(getattr(node, "state", None), RegionState):
            nodes.append(node)
    return nodes


def _bridged(tensor: torch.Tensor, key: Hashable | None) -> torch.Tensor:
    """``tensor``, or its recomputation for ``key`` when a reentrant region made it."""
    node = tensor.grad_fn
    producer = getattr(node, "state", None) if node is not None else None
    kept = producer.materialized.get(key) if isinstance(producer, RegionState) else None
    if kept is not None:
        recomputed = kept.outputs[tensor.output_nr]
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
    state: RegionState, saved: tuple[torch.Tensor, ...], key: Hashable | None
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
