"""Where a reentrant region's nested backward sends its gradients.

Part of the reentrant variant (``reentrant``, ``docs/design/reentrant.md``).
The nested ``autograd.grad`` gives one gradient per stand-in and per tensor
captured whole; :func:`edge_gradients` puts each on the edge of the node the
unchecked run would add it to. :func:`find_exits` walks the recomputed graph
for edges no stand-in covers (a custom ``autograd.Function`` taking a tensor
directly), :class:`Arrivals` collects such a Function's gradients node by
node, and :func:`check_exits` refuses what cannot be given as torch gives it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from remat._compat.autograd import AccumulateGrad, is_checkpoint_valid, node_sequence_nr
from remat._compat.versions import backward_from_edges_supported
from remat._engine.reentrant_uses import RegionState
from remat.errors import CheckpointError

__all__ = ["Arrivals", "Exit", "check_exits", "edge_gradients", "find_exits"]


class Arrivals:
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


# A way out of the recomputed graph that no stand-in covers: the leaf or the
# gradient edge, what it is (for messages), and the node that leads to it.
Exit = tuple[Any, str, str]


def find_exits(
    state: RegionState,
    roots: list[torch.Tensor],
    fresh: list[torch.Tensor],
    whole: list[tuple[int, torch.Tensor]],
    sources: list[torch.Tensor | None],
    made: range,
) -> tuple[list[tuple[int, torch.Tensor]], list[Exit], list[tuple[Any, int, torch.Tensor]]]:
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
    exits: list[Exit] = []
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


def check_exits(api: str, exits: list[Exit], higher: bool) -> None:
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


def edge_gradients(
    state: RegionState,
    edges: int,
    standins: list[tuple[int, int, torch.Tensor]],
    quiet: list[tuple[int, int]],
    captures: list[tuple[int, torch.Tensor]],
    grads: tuple[torch.Tensor | None, ...],
    arrivals: Arrivals | None,
    loose: list[tuple[int, torch.Tensor]],
) -> list[torch.Tensor | None]:
    """One gradient per edge of the node (see :meth:`RegionState.lay_out`); the
    gradients of targets whose edge is a dead end go to ``loose``."""
    out: list[torch.Tensor | None] = [None] * edges

    def add(edge: int, grad: torch.Tensor) -> None:
        current = out[edge]
        out[edge] = grad if current is None else current + grad

    dead = state.dead_ends
    # Per target, the edge a whole gradient goes to (-1: none, a dead end).
    last = [-1 if target in dead else mine[-1] for target, mine in enumerate(state.edges_of)]
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
                if target in dead:  # the forward never read it: as a custom Function's
                    loose.append((target, grad))
                    continue
                add(mine[min(filled[target], len(mine) - 1)], grad)
                filled[target] += 1
    if arrivals is not None:  # node by node: a custom Function's to the use inside its forward
        got = [(captures[position][0], number, grad) for number, position, grad in arrivals.got]
    else:  # a use no stand-in caught (a custom Function's input)
        got = [(target, -2, grad) for (target, _), grad in zip(captures, grads[len(standins) :], strict=True) if grad is not None]
    for target, number, grad in got:
        edge = inside.get((target, number + 1), last[target])
        if edge < 0:
            loose.append((target, grad))  # an input the forward never read: a dead end
        else:
            add(edge, grad)
    return out
