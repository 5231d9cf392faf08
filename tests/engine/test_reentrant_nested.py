"""Reentrant regions nested in reentrant regions, with closures: the plain run's results, bitwise.

A reentrant region's node has an edge to each of its tensor inputs, whether
its function uses them or not. Nested in an enclosing region's
recomputation, such an edge must not lead out of the enclosing region: the
enclosing region's nested backward would walk into the graph outside it. The
inputs an inner region gets are therefore targets of every enclosing region,
and an edge to one that the inner function never uses goes to a stand-in of
its own (docs/design/reentrant.md, "Nesting").

Each program here is the plain run with some of its functions wrapped in
``use_reentrant=True`` checkpoints, and the gradients are taken in each way
a training loop takes them, double backward included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from helpers import PLAIN, Impl, ScaleByWeight, assert_same, get_impl
from remat._compat.versions import backward_from_edges_supported
from remat.errors import CheckpointError

REMAT = get_impl("remat")
HOWS = ["backward", "retain_twice", "two_losses", "grad", "inputs"]


def reentrant(ck: Impl, fn: Callable[..., Any], *args: Any) -> Any:
    return ck.checkpoint(fn, *args, use_reentrant=True)


def plain_region(ck: Impl, fn: Callable[..., Any], *args: Any) -> Any:
    return ck.checkpoint(fn, *args, use_reentrant=False)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


def take_gradients(how: str, out: torch.Tensor, extra: torch.Tensor, wrt: list[torch.Tensor]) -> Any:
    """The loss ``out`` plus ``extra`` (a second loss over part of the graph), differentiated ``how``."""
    loss = out.pow(2).sum() + extra
    if how == "backward":
        loss.backward()
        return [t.grad for t in wrt]
    if how == "retain_twice":
        loss.backward(retain_graph=True)
        first = [None if t.grad is None else t.grad.clone() for t in wrt]
        loss.backward()
        return first, [t.grad for t in wrt]
    if how == "two_losses":
        out.sum().backward(retain_graph=True)
        first = [None if t.grad is None else t.grad.clone() for t in wrt]
        loss.backward()
        return first, [t.grad for t in wrt]
    if how == "grad":
        return torch.autograd.grad(loss, wrt, allow_unused=True)
    loss.backward(inputs=wrt[1:])
    return [t.grad for t in wrt]


def _unused_input_program(
    ck: Impl, spare_kind: str, outermost: str, how: str, reads_shape: bool, spare_outside: bool = True
) -> Any:
    """Three regions, each inside the one before; the innermost gets ``spare``,
    which no function reads but possibly by its shape (and the loss, with
    ``spare_outside``)."""
    torch.manual_seed(0)
    x, w, source = randn(4, 4), randn(4, 4), randn(4, 4)
    # A parameter, or an activation with history outside every region.
    spare = source if spare_kind == "parameter" else (source @ w).tanh()

    def innermost(h: torch.Tensor, ignored: torch.Tensor) -> torch.Tensor:
        scale = ignored.shape[0] / 4 if reads_shape else 1.0
        return (h @ w).sigmoid() * scale

    def middle(h: torch.Tensor) -> torch.Tensor:
        return reentrant(ck, innermost, h.cos(), spare) * h  # spare reaches it by closure

    def outer(h: torch.Tensor) -> torch.Tensor:
        return reentrant(ck, middle, h.sin()) + h

    wrap = reentrant if outermost == "reentrant" else plain_region
    out = wrap(ck, outer, x * 2)
    extra = spare.exp().sum() if spare_outside else x.sum()
    return out, take_gradients(how, out, extra, [x, w, source])


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("outermost", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("spare_kind", ["parameter", "activation"])
def test_inner_region_input_that_no_function_uses(spare_kind: str, outermost: str, how: str) -> None:
    expected = _unused_input_program(PLAIN, spare_kind, outermost, how, reads_shape=False)
    assert_same(_unused_input_program(REMAT, spare_kind, outermost, how, reads_shape=False), expected)


@pytest.mark.parametrize("how", ["backward", "grad"])
def test_inner_region_input_read_only_by_its_shape(how: str) -> None:
    expected = _unused_input_program(PLAIN, "activation", "reentrant", how, reads_shape=True)
    assert_same(_unused_input_program(REMAT, "activation", "reentrant", how, reads_shape=True), expected)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # torch's, inside no_grad
@pytest.mark.parametrize("spare_kind", ["parameter", "activation"])
def test_torch_runs_the_single_backward_too(spare_kind: str) -> None:
    # What made refusing these a regression: torch's reentrant checkpoint runs
    # them (its nested backward reassociates some sums: equal to rounding),
    # unless an activation is also used outside (it walks into its graph).
    kwargs = {"reads_shape": False, "spare_outside": spare_kind == "parameter"}
    expected = _unused_input_program(PLAIN, spare_kind, "reentrant", "backward", **kwargs)
    got = _unused_input_program(get_impl("torch"), spare_kind, "reentrant", "backward", **kwargs)
    torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-15)


class _Hidden(torch.autograd.Function):
    """A custom Function whose forward runs no Python torch call on its
    weight (as a C++ extension's): the only way in is the node's edge."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h, w)
        with torch._C.DisableTorchFunction():
            return h * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, w = ctx.saved_tensors
        return grad * w, (grad * h).sum(0)


@pytest.mark.parametrize("how", ["backward", "grad", "inputs"])
def test_inner_region_hands_its_input_to_a_custom_function(how: str) -> None:
    # The inner region's input reaches only a custom Function that never
    # shows it to Python: the gradient comes back through the inner node's
    # edge, which inside the enclosing recomputation is a stand-in.
    def program(ck: Impl) -> Any:
        torch.manual_seed(0)
        norm = nn.LayerNorm(4).double()
        x, source = randn(3, 4), randn(4)
        weight = source.exp()  # history outside the regions

        def inner(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return _Hidden.apply(norm(h), w).tanh()

        def outer(h: torch.Tensor) -> torch.Tensor:
            return reentrant(ck, inner, h.cos(), weight) + h

        out = reentrant(ck, outer, x * 2)
        return out, take_gradients(how, out, weight.sum(), [x, source, norm.weight])

    assert_same(program(REMAT), program(PLAIN))


@pytest.mark.parametrize("how", HOWS)
def test_sequential_segments_inside_a_reentrant_block_read_the_outer_graph(how: str) -> None:
    # A reentrant checkpoint_sequential inside a reentrant region, over a
    # tensor the region never read: it arrives as the segments' input.
    def program(ck: Impl) -> Any:
        torch.manual_seed(0)
        x, other, w = randn(2, 3), randn(2, 3), randn(3, 3)
        memory = other.softmax(1)  # an activation with history outside

        def block(h: torch.Tensor) -> torch.Tensor:
            steps = nn.Sequential(nn.Identity(), _Lambda(lambda v: v @ w), _Lambda(torch.relu))
            inner = ck.checkpoint_sequential(steps, 2, memory, use_reentrant=True)
            return h.sin() + inner.sum() * 0.1

        out = reentrant(ck, block, x.t().t())
        return out, take_gradients(how, out, memory.sum(), [x, other, w])

    assert_same(program(REMAT), program(PLAIN))


class _Lambda(nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fn(h)


# --- A region that reads none of its inputs ------------------------------------
# A reentrant region whose function reads none of the tensors it was given that
# require grad (it works on constants, and may return such an input as it came
# in) still has an edge to each, so its outputs require grad wherever it runs.
# Made inside a non-reentrant region that runs in an enclosing reentrant
# region's recomputation, it is made again when that region is recomputed,
# with no enclosing frame active: its outputs must require grad there too, or
# the ops after it save fewer tensors than in the forward (a
# RecomputeMismatchError, or with early stop a saved tensor never produced).
# docs/design/reentrant.md, "Nesting".


def _reads_no_input_program(ck: Impl, returns_input: bool, early_stop: bool, how: str) -> Any:
    """reentrant > plain > reentrant; the innermost reads only constants."""
    torch.manual_seed(0)
    x, w = randn(3, 4), randn(4, 4)
    constant = torch.randn(3, 4, dtype=torch.float64)

    def innermost(spare: torch.Tensor) -> Any:
        made = F.dropout(constant.cos(), p=0.5, training=True) @ constant.t()
        return (made, spare) if returns_input else made

    def middle(h: torch.Tensor) -> torch.Tensor:
        out = reentrant(ck, innermost, h.tanh())
        made, spare = out if returns_input else (out, h)
        return (made.sum(1, keepdim=True) * spare).sigmoid() @ w  # saves what it reads

    def outer(h: torch.Tensor) -> torch.Tensor:
        return ck.checkpoint(middle, h * 2, use_reentrant=False, early_stop=early_stop) + h

    out = reentrant(ck, outer, x.sin())
    return out, take_gradients(how, out, x.sum(), [x, w])


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("returns_input", [False, True], ids=["constants", "returns_its_input"])
def test_region_reading_none_of_its_inputs_in_a_plain_region_in_a_recomputation(
    returns_input: bool, early_stop: bool, how: str
) -> None:
    expected = _reads_no_input_program(PLAIN, returns_input, early_stop, how)
    assert_same(_reads_no_input_program(REMAT, returns_input, early_stop, how), expected)


@pytest.mark.parametrize("outer", [None, "reentrant", "plain"])
@pytest.mark.parametrize("middle", [None, "reentrant", "plain"])
def test_region_making_its_outputs_from_constants(outer: str | None, middle: str | None) -> None:
    # Its outputs require grad (it has a target), the recomputed ones do not:
    # its backward yields nothing, as the unchecked run has nothing to give.
    def wrap(ck: Impl, kind: str | None, fn: Callable[..., Any], h: torch.Tensor) -> Any:
        return fn(h) if kind is None else ck.checkpoint(fn, h, use_reentrant=kind == "reentrant")

    def program(ck: Impl) -> Any:
        torch.manual_seed(0)
        x = randn(3)
        constant = torch.randn(3, dtype=torch.float64)

        def middle_fn(h: torch.Tensor) -> torch.Tensor:
            return (reentrant(ck, lambda spare: constant.sin(), h) * h).sum()

        out = wrap(ck, outer, lambda h: wrap(ck, middle, middle_fn, h * 2), x)
        out.backward()
        return out, x.grad

    assert_same(program(REMAT), program(PLAIN))


@pytest.mark.parametrize("weight_kind", ["leaf", "activation"])
@pytest.mark.parametrize("outermost", [None, "reentrant", "plain"])
def test_input_only_a_custom_function_takes(outermost: str | None, weight_kind: str) -> None:
    # The region reads nothing that requires grad in Python; a custom Function
    # takes its input as it is. Its outputs require grad (the input has its
    # edge), so the input gets its gradient: from the top level as torch gives
    # it (a nested backward of its own: from an activation's gradient edge
    # from torch 2.7), inside an enclosing region through the edge's
    # stand-in. (Without the edge: no gradient at all.)
    def program(ck: Impl) -> Any:
        torch.manual_seed(0)
        x, source = randn(3, 4), randn(4)
        weight = source if weight_kind == "leaf" else source.exp()
        constant = torch.randn(3, 4, dtype=torch.float64)

        def inner(w: torch.Tensor) -> torch.Tensor:
            return _Hidden.apply(constant, w).tanh()

        def body(h: torch.Tensor) -> torch.Tensor:
            return reentrant(ck, inner, weight) * h

        if outermost is None:
            out = body(x)
        else:
            out = ck.checkpoint(body, x.cos(), use_reentrant=outermost == "reentrant")
        out.pow(2).sum().backward()
        return out, x.grad, source.grad

    top_level = outermost != "reentrant"  # (a plain region's backward is no reentrant backward)
    if top_level and weight_kind == "activation" and not backward_from_edges_supported():
        with pytest.raises(CheckpointError, match=r"2\.7"):
            program(REMAT)
        return
    assert_same(program(REMAT), program(PLAIN))


@pytest.mark.parametrize("how", HOWS)
def test_plain_region_bookkeeping_is_no_use_of_the_enclosing_region(how: str) -> None:
    # The plain region's pack hook asks Tensor._is_view() of the weight it saves
    # (read from outside). It runs in the reentrant region's recomputation, not
    # in its forward (under no_grad the plain region is inert): were that a use,
    # the recomputation's uses would not match the forward's, and the custom
    # Function's gradient to x (which it takes as it is) would be added at x's
    # last edge, not at the use inside its forward (not bitwise).
    def program(ck: Impl) -> Any:
        torch.manual_seed(0)
        x, gain = randn(4, 4), randn(4)

        def body(h: torch.Tensor) -> torch.Tensor:
            dropped = F.dropout(h, p=0.3, training=True)
            return dropped * h.cos() + ScaleByWeight.apply(h, gain) * gain

        out = reentrant(ck, lambda h: plain_region(ck, body, h), x) * gain
        return out, take_gradients(how, out, (x * gain).sum(), [x, gain])

    assert_same(program(REMAT), program(PLAIN))


# The five fuzz programs of the report (mixed-nesting-recompute), each reduced
# to what made its recomputation differ.


@pytest.mark.parametrize("how", ["backward", "retain_twice"])
def test_fuzz_inner_region_returns_its_unread_input_after_dropout(how: str) -> None:
    # prog_9002926, prog_30001765: reentrant > plain (early stop off) >
    # reentrant reading closures made from constants (a dropout among them),
    # returning its one input that requires grad as it came in.
    def program(ck: Impl) -> Any:
        torch.manual_seed(1)
        x, w = randn(4, 4), randn(4, 4)
        constant = torch.randn(4, 4, dtype=torch.float64)

        def outer(a: torch.Tensor) -> torch.Tensor:
            made = (a @ w).mean(1, keepdim=True)  # history in the recomputation

            def middle(h: torch.Tensor) -> torch.Tensor:
                fixed = constant.clone()
                fixed.tanh_()

                def inner(skipped: torch.Tensor, passed: torch.Tensor) -> Any:
                    dropped = F.dropout(fixed @ constant, p=0.2, training=True)
                    return dropped.softmax(0), passed

                with ck.set_checkpoint_early_stop(False):
                    dropped, passed = reentrant(ck, inner, fixed, made)
                return (h * dropped).sum() + passed.sum() + dropped.sum()

            return ck.checkpoint(middle, a, use_reentrant=False, early_stop=False) * a

        out = reentrant(ck, outer, x)
        return out, take_gradients(how, out, x.sum(), [x, w])

    assert_same(program(REMAT), program(PLAIN))


def test_fuzz_inner_region_in_a_selective_region_early_stop() -> None:
    # prog_9004383: reentrant > plain with an op list (SAC) > reentrant
    # reading a closure that does not require grad, returning its unread input.
    def program(ck: Impl) -> Any:
        torch.manual_seed(2)
        x, y = randn(3, 3), randn(3, 3)
        constant = torch.randn(3, 3, dtype=torch.float64)
        options: dict[str, Any] = {}
        if ck is REMAT:
            options["policy"] = [torch.ops.aten.mm.default, torch.ops.aten.sigmoid.default]

        def outer(a: torch.Tensor, b: torch.Tensor) -> Any:
            def middle(h: torch.Tensor) -> Any:
                square = h @ h
                inner = reentrant(ck, lambda p, q, r: (constant.softmax(1), r), square.cos(), h, h @ square)
                return (inner[0] * h).sigmoid().sum() + inner[1].sum(), h @ b

            summed, made = ck.checkpoint(middle, a, use_reentrant=False, **options)
            return made @ x + summed

        out = reentrant(ck, outer, y, x)
        out.sum().backward()
        return out, x.grad, y.grad

    assert_same(program(REMAT), program(PLAIN))


def test_fuzz_inner_region_in_a_reentrant_segment() -> None:
    # prog_30000077: a reentrant checkpoint_sequential segment > plain region >
    # reentrant region returning its unread input.
    def program(ck: Impl) -> Any:
        torch.manual_seed(3)
        x = randn(2, 2)
        constant = torch.randn(2, 4, dtype=torch.float64)

        def inner(kept: torch.Tensor, spare: torch.Tensor, read: torch.Tensor) -> Any:
            normed = F.layer_norm(read, (4,))
            return F.linear(normed, read) @ normed, spare

        def middle(h: torch.Tensor) -> torch.Tensor:
            made, spare = reentrant(ck, inner, constant, h, constant)
            return F.layer_norm(made, (4,)).sum(0) + (spare @ constant).sum()

        def segment(h: torch.Tensor) -> torch.Tensor:
            with ck.set_checkpoint_early_stop(True):
                made = ck.checkpoint(middle, h, use_reentrant=False)
            return h + made.sum().tanh()

        def first(h: torch.Tensor) -> torch.Tensor:
            return h * 2

        # (The last segment runs unchecked: ``segment`` must not be last.)
        out = ck.checkpoint_sequential([first, segment, torch.sin], 3, x, use_reentrant=True)
        out.sum().backward()
        return out, x.grad

    assert_same(program(REMAT), program(PLAIN))


def test_fuzz_name_seen_in_the_forward_only() -> None:
    # prog_20004797: plain region under a policy > plain region > reentrant
    # checkpoint_sequential whose segment is a name tag: under the policy's
    # mode in the forward, remat.name is an op (a use of its input); in the
    # recomputation it returns its input at once (no use).
    def program(ck: Impl) -> Any:
        torch.manual_seed(4)
        x, p = randn(3, 4), randn(4)
        options: dict[str, Any] = {"policy": remat.policies.save_nothing} if ck is REMAT else {}

        def tag(h: torch.Tensor) -> torch.Tensor:
            return remat.name(h, "act")

        def shifted(h: torch.Tensor) -> torch.Tensor:
            return h.expand(3, 4) + 0.1 * (x @ p).sum()

        def middle(h: torch.Tensor) -> torch.Tensor:
            made = ck.checkpoint_sequential([tag, shifted], 2, p, use_reentrant=True)
            return h.relu().sum() + made.sum()

        def outer(h: torch.Tensor) -> torch.Tensor:
            return ck.checkpoint(middle, h, use_reentrant=False) * 2

        out = ck.checkpoint(outer, x + 1, use_reentrant=False, early_stop=True, **options)
        out.backward()
        return out, x.grad, p.grad

    assert_same(program(REMAT), program(PLAIN))


# --- Double backward ----------------------------------------------------------
# Under create_graph=True a region keeps its recomputation's graph, with edges
# to what it read, and the second backward goes through it (bitwise for a
# gradient penalty beside other forwards: tests/engine/test_gradient_penalty.py).


class _CrossBlock(nn.Module):
    """Attention from ``x`` to a ``memory`` read by closure (history outside every region)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.norm, self.q, self.kv = nn.LayerNorm(dim), nn.Linear(dim, dim), nn.Linear(dim, 2 * dim)
        self.memory: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.memory is not None
        k, v = self.kv(self.memory).chunk(2, dim=-1)
        attended = (self.q(self.norm(x)) @ k.t()).softmax(-1) @ v
        return x + attended.tanh()


def _penalized(
    score: torch.Tensor, x: torch.Tensor, order: int, params: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """A gradient penalty on ``score``'s input gradient (order 2), or on the
    penalty's own (order 3): the input gradients of each order, and the
    gradients of penalty plus score for ``params``."""
    (grad,) = torch.autograd.grad(score, x, create_graph=True)
    penalty = (grad.norm(dim=1) - 1).pow(2).mean()
    firsts = [grad]
    if order == 3:
        (again,) = torch.autograd.grad(penalty, x, create_graph=True)
        firsts.append(again)
        penalty = again.pow(2).sum()
    return firsts, list(torch.autograd.grad(penalty + score, params, allow_unused=True))


def _penalty_program(ck: Impl, order: int) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """A reentrant stack of reentrant blocks reading a closure; the input gradient
    (first order) and the gradients of a penalty on it (order 2) or of a penalty
    on the penalty's input gradient (order 3)."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(_CrossBlock() for _ in range(2)).double()
    x, source = randn(4, 8), randn(3, 8)
    memory = (source @ blocks[0].q.weight).tanh()
    for block in blocks:
        block.memory = memory

    def stack(h: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            h = reentrant(ck, block, h)
        return h

    score = (reentrant(ck, stack, x.sin()) * memory.sum(0)).sum()
    return _penalized(score, x, order, [x, source, *blocks.parameters()])


@pytest.mark.parametrize("order", [2, 3])
def test_penalty_through_nested_reentrant_regions_reading_a_closure(order: int) -> None:
    # The gradients a higher backward starts from are bitwise; the last one
    # backpropagates the score through the regions' outputs in the same pass
    # as the penalty, so some terms meet at a target in another order.
    (got_first, got), (want_first, want) = _penalty_program(REMAT, order), _penalty_program(PLAIN, order)
    assert_same(got_first, want_first)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # torch's, inside no_grad
def test_torch_refuses_the_penalty_through_a_reentrant_region() -> None:
    # What remat adds here (if torch ever learns it, this fails): torch's
    # reentrant variant takes no torch.autograd.grad, let alone create_graph.
    with pytest.raises(RuntimeError, match=r"incompatible with \.grad\(\)"):
        _penalty_program(get_impl("torch"), 2)


def test_double_backward_where_a_custom_function_hides_a_weight_says_so() -> None:
    # The weight reaches the recomputed graph only through the custom node's
    # edge: a nested backward of its own would give first-order terms only.
    weight = randn(4)
    norm = nn.LayerNorm(4).double()
    x = randn(3, 4)
    out = reentrant(REMAT, lambda h: _Hidden.apply(norm(h), weight).tanh() + h, x.cos())
    with pytest.raises(CheckpointError, match=r"double backward.*_HiddenBackward.*leaf tensor of shape \(4,\)"):
        torch.autograd.grad(out.sum(), x, create_graph=True)


def _producer_in_a_plain_region_program(ck: Impl, order: int) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """A reentrant region inside a plain one makes ``made``; a second reentrant
    region holds a third that gets ``made`` and never reads it. A penalty on
    the input gradient (order 2), or on the penalty's (order 3)."""
    torch.manual_seed(0)
    x, w = randn(4, 4), randn(4, 4)
    made = plain_region(ck, lambda h: reentrant(ck, lambda g: (g @ w).tanh(), h), x)

    def consumer(h: torch.Tensor) -> torch.Tensor:
        return reentrant(ck, lambda unused: (h @ w).sin(), made) * h

    score = (reentrant(ck, consumer, x) + made).pow(2).sum()
    return _penalized(score, x, order, [x, w])


@pytest.mark.parametrize("order", [2, 3])
def test_penalty_through_a_producer_inside_a_plain_region(order: int) -> None:
    # The consumer's double backward recomputes the producer first; the inner
    # region's, run in the consumer's nested backward (another backward call),
    # needs it too. Kept per call, the inner call's recomputation no longer
    # replaces the one the producer's own backward takes in the outer call,
    # which had to unpack its saved tensors again: an error in a plain region,
    # whose recomputed tensors are handed out once per call.
    # The first-order gradient is bitwise; second-order ones (the penalty's
    # input gradient, the last) to rounding: the score also goes through the
    # regions' outputs in the same pass (docs/design/reentrant.md).
    (got_first, got), (want_first, want) = (
        _producer_in_a_plain_region_program(REMAT, order),
        _producer_in_a_plain_region_program(PLAIN, order),
    )
    assert_same(got_first[0], want_first[0])
    torch.testing.assert_close(got_first[1:] + got, want_first[1:] + want, rtol=1e-12, atol=1e-12)
