"""Selective checkpointing (SAC): differential against torch's SAC, op counts, errors."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as tuc

import remat
import remat.policies as P
from helpers import (
    TORCH_SAC,
    OpCounter,
    assert_same,
    attention_block,
    dtensor_api,
    squared_loss_grads,
    torch_checkpoint_api,
    two_tensor_class,
)
from remat.errors import PolicyError
from remat.names import NAMED_OP
from remat.policies import CheckpointPolicy

MM = torch.ops.aten.mm.default
SIGMOID = torch.ops.aten.sigmoid.default


def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(torch.mm(torch.mm(x, w), w)).exp()


def leaves() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(6, 6, requires_grad=True), torch.randn(6, 6, requires_grad=True)


def run_remat(context_fn: Any = None, policy: Any = None) -> tuple[tuple[torch.Tensor, ...], Any]:
    x, w = leaves()
    options: dict[str, Any] = {"policy": policy} if policy is not None else {"context_fn": context_fn}
    out = remat.checkpoint(fn, x, w, **options)
    with OpCounter() as ops:
        grads = torch.autograd.grad(out.sum(), (x, w))
    return grads, ops.take()


def reference() -> tuple[torch.Tensor, ...]:
    x, w = leaves()
    return torch.autograd.grad(fn(x, w).sum(), (x, w))


def contexts_factory(maker: str) -> Any:
    """remat's or torch's create_selective_checkpoint_contexts (skips where torch lacks it)."""
    if maker == "remat":
        return remat.create_selective_checkpoint_contexts
    return torch_checkpoint_api("create_selective_checkpoint_contexts")


def tuc_has_sac() -> bool:
    return hasattr(tuc, "create_selective_checkpoint_contexts")


def torch_sac(spec: Any) -> tuple[torch.Tensor, ...]:
    x, w = leaves()
    ctx = functools.partial(torch_checkpoint_api("create_selective_checkpoint_contexts"), spec)
    return torch.autograd.grad(tuc.checkpoint(fn, x, w, use_reentrant=False, context_fn=ctx).sum(), (x, w))


@pytest.mark.parametrize("maker", ["remat", "torch"])
def test_list_of_ops_saves_them_and_matches_unchecked(maker: str) -> None:
    make = contexts_factory(maker)
    grads, ops = run_remat(functools.partial(make, [MM]))
    for got, want in zip(grads, reference(), strict=True):
        assert torch.equal(got, want)
    if tuc_has_sac():  # torch's own SAC as a second oracle (torch >= 2.5)
        for got, torch_got in zip(grads, torch_sac([MM]), strict=True):
            assert torch.equal(got, torch_got)
    # Backward itself runs 4 mm (grads of two matmuls); none from the recompute.
    assert ops["aten.mm.default"] == 4


def test_plain_recompute_reruns_the_matmuls() -> None:
    _, saved = run_remat(policy=P.save_matmuls)
    _, recomputed = run_remat(policy=P.save_nothing)
    assert saved["aten.mm.default"] == 4
    assert recomputed["aten.mm.default"] == 6  # + the two forward matmuls rerun


@pytest.mark.parametrize("enum_from", ["remat", "torch"])
def test_must_save_op_is_not_rerun_and_prefer_recompute_is(enum_from: str) -> None:
    decisions = P.CheckpointPolicy if enum_from == "remat" else torch_checkpoint_api("CheckpointPolicy")

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return decisions.MUST_SAVE if op is SIGMOID else decisions.PREFER_RECOMPUTE

    grads, ops = run_remat(policy=policy)
    assert ops["aten.sigmoid.default"] == 0
    assert ops["aten.mm.default"] == 6
    for got, want in zip(grads, reference(), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("maker", ["remat", "torch"])
def test_bad_policy_specs(maker: str) -> None:
    make = contexts_factory(maker)
    with pytest.raises(ValueError, match=r"mm\.default"):
        make([torch.ops.aten.mm])
    with pytest.raises(ValueError):
        make(["mm"])
    with pytest.raises(TypeError):
        make(42)


def test_policy_returning_none_names_policy_and_op() -> None:
    def undecided(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> None:
        return None

    x, w = leaves()
    with pytest.raises(PolicyError, match=r"undecided.*returned None"):
        remat.checkpoint(fn, x, w, policy=undecided)


def test_mutating_a_cached_output_raises_unless_allowed() -> None:
    def mutating(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = torch.mm(x, w)
        out = y.sigmoid()
        y.mul_(2)  # after sigmoid saved its output; mm's cached output is now stale
        return out * y

    for allow, expect_error in ((False, True), (True, False)):
        x, w = leaves()
        ctx = functools.partial(remat.create_selective_checkpoint_contexts, [MM], allow_cache_entry_mutation=allow)
        out = remat.checkpoint(mutating, x, w, context_fn=ctx)
        if expect_error:
            with pytest.raises(remat.CheckpointError, match="allow_cache_entry_mutation"):
                out.sum().backward()
        else:
            out.sum().backward()


def test_matmul_vector_matrix_is_not_a_false_mutation() -> None:
    x = torch.randn(5, requires_grad=True)
    w = torch.randn(5, 3, requires_grad=True)
    out = remat.checkpoint(lambda a, b: torch.matmul(a, b).sin(), x, w, policy=[MM])
    gx, gw = torch.autograd.grad(out.sum(), (x, w))
    rx, rw = torch.autograd.grad(torch.matmul(x, w).sin().sum(), (x, w))
    assert torch.equal(gx, rx) and torch.equal(gw, rw)
    lin = torch.nn.Linear(5, 3)
    out = remat.checkpoint(lin, x, policy=P.save_matmuls)
    out.sum().backward()


def test_repeated_backward_replays_the_cache_and_matches_unchecked() -> None:
    # A selective region serves as many backwards as the graph allows: each
    # retained backward recomputes and replays the cached matmuls again.
    expected = reference()
    x, w = leaves()
    loss = remat.checkpoint(fn, x, w, policy=[MM]).sum()
    with OpCounter() as ops:
        for _ in range(3):
            got = torch.autograd.grad(loss, (x, w), retain_graph=True)
            assert ops.take()["aten.mm.default"] == 4  # backward's own; none recomputed
            for g, want in zip(got, expected, strict=True):
                assert torch.equal(g, want)


@pytest.mark.parametrize("retain_graph", [False, True])
def test_cached_outputs_live_as_long_as_the_graph_holds_the_region(retain_graph: bool) -> None:
    storages: list[weakref.ref[torch.UntypedStorage]] = []

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = torch.mm(x, w)
        storages.append(weakref.ref(h.untyped_storage()))
        return torch.sigmoid(torch.mm(h, w)).exp()

    x, w = leaves()
    loss = remat.checkpoint(block, x, w, policy=[MM]).sum()
    cached = storages[0]  # the first matmul's output: only the cache keeps it
    assert cached() is not None
    loss.backward(retain_graph=retain_graph)
    if retain_graph:
        assert cached() is not None  # the graph still holds the region
        loss.backward()
    # Freed with the graph's hold on the region, at once (no cycle for gc).
    assert cached() is None
    assert loss.grad_fn is not None  # the graph object itself is still here


def test_offloaded_output_written_in_place_replays_unchanged_each_backward() -> None:
    # The forward writes into the matmul's output after its host copy was
    # taken; every recomputation writes into what it is served again. Each
    # backward must be served the value as it was cached, not the last
    # recomputation's (on CPU the host copy is the restored tensor itself).
    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x @ w  # 3-d: mm's output comes back through _unsafe_view
        h[..., ::2].mul_(2.0)
        return torch.nn.functional.layer_norm(h.relu_(), (6,)) * h

    def offload_mm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_OFFLOAD if op is MM else CheckpointPolicy.PREFER_RECOMPUTE

    def grads(checkpointed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        x = torch.randn(2, 6, 6, dtype=torch.float64, requires_grad=True)
        w = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)
        out = remat.checkpoint(block, x, w, policy=offload_mm) if checkpointed else block(x, w)
        loss = out.pow(2).sum()
        return [g for _ in range(3) for g in torch.autograd.grad(loss, (x, w), retain_graph=True)]

    for got, want in zip(grads(True), grads(False), strict=True):
        assert torch.equal(got, want)


def test_policy_and_context_fn_together_is_an_error() -> None:
    x, w = leaves()
    with pytest.raises(ValueError, match="either policy= or context_fn="):
        remat.checkpoint(fn, x, w, policy=P.save_matmuls, context_fn=remat.noop_context_fn.__call__)


def test_combinators() -> None:
    first = P.first_of(P.save_ops(SIGMOID), P.save_nothing)
    union = P.save_any_of(P.save_ops(SIGMOID), P.save_matmuls)
    _, ops_first = run_remat(policy=first)
    _, ops_union = run_remat(policy=union)
    assert (ops_first["aten.sigmoid.default"], ops_first["aten.mm.default"]) == (0, 6)
    assert (ops_union["aten.sigmoid.default"], ops_union["aten.mm.default"]) == (0, 4)
    assert P.save_matmuls.reason and P.save_nothing.reason


def test_save_matmuls_without_batch_dims_reruns_bmm() -> None:
    def attention_like(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = torch.mm(x, w).view(2, 3, 6)
        return torch.bmm(h, h.transpose(1, 2)).softmax(-1).sum()

    for policy, bmm_reruns in ((P.save_matmuls, 0), (P.save_matmuls_without_batch_dims, 1)):
        x, w = leaves()
        out = remat.checkpoint(attention_like, x, w, policy=policy)
        with OpCounter() as ops:
            out.backward()
        assert ops.take()["aten.bmm.default"] == 2 + bmm_reruns  # 2 from bmm's backward


def test_offload_decision_round_trips_bit_identical() -> None:
    grads, ops = run_remat(policy=lambda ctx, op, *a, **k: P.CheckpointPolicy.MUST_CPU_OFFLOAD if op is MM else False)
    assert ops["aten.mm.default"] == 4
    for got, want in zip(grads, reference(), strict=True):
        assert torch.equal(got, want)


def test_checkpoint_policy_enum_matches_torch() -> None:
    for member in torch_checkpoint_api("CheckpointPolicy"):
        assert P.CheckpointPolicy[member.name].value == member.value
    assert P.CheckpointPolicy.MUST_OFFLOAD is P.CheckpointPolicy.MUST_CPU_OFFLOAD


@pytest.mark.parametrize("allow", [False, True])
def test_in_place_write_through_matmuls_alias_is_not_replayed_silently(allow: bool) -> None:
    # torch.matmul on 3-d inputs returns its mm output through _unsafe_view, an
    # alias with a version counter of its own: the write below changes the cached
    # mm value without bumping the cached tensor's version.
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)

    def block(x: torch.Tensor) -> torch.Tensor:
        h = x @ w
        h.mul_(2)
        return h.sin()

    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    want = torch.autograd.grad(block(x).sum(), (x, w))
    contexts = functools.partial(
        remat.create_selective_checkpoint_contexts, [MM], allow_cache_entry_mutation=allow
    )
    out = remat.checkpoint(block, x, context_fn=contexts)
    if allow:  # the documented opt-out: the forward's (mutated) value is replayed
        torch.autograd.grad(out.sum(), (x, w))
        return
    with pytest.raises(remat.CheckpointError, match="modified in place afterwards"):
        torch.autograd.grad(out.sum(), (x, w))
    # The same program without the cache is right.
    got = torch.autograd.grad(remat.checkpoint(block, x).sum(), (x, w))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_op_only_policies_are_asked_once_per_op_per_region() -> None:
    # A policy that declares it decides by the op alone is asked once per op
    # and region (the per-op cost of eager SAC); the result is the same.
    import dataclasses

    from remat.policies import Policy

    asked: list[Any] = []

    @dataclasses.dataclass(frozen=True)
    class SaveMm(Policy):
        def decide(self, op: Any, args: Any, kwargs: Any) -> CheckpointPolicy | None:
            asked.append(op)
            return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else None

        def decides_by_op_only(self) -> bool:
            return True

    w = torch.randn(8, 8, requires_grad=True)

    def body(x: torch.Tensor) -> torch.Tensor:
        for _ in range(5):
            x = (x @ w).tanh()
        return x

    x = torch.randn(8, 8, requires_grad=True)
    expected = torch.autograd.grad(body(x).sum(), (x, w))
    out = remat.checkpoint(body, x, policy=SaveMm())
    got = torch.autograd.grad(out.sum(), (x, w))
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    ops = [op for op in asked if op is not NAMED_OP]
    assert sorted(map(str, ops)) == ["aten.mm.default", "aten.tanh.default"], asked


# A policy that saves the output of an in-place op on a view: the recomputation must
# replay the write, or the gradient comes out wrong.


def _scale_a_slice(t: torch.Tensor) -> torch.Tensor:
    h = t * 3
    h[:, :2].mul_(0.5)  # in-place op on a view: its write must happen again in recompute
    return h.sin()


def _save_in_place_muls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> remat.CheckpointPolicy:
    if op in (torch.ops.aten.mul_.Tensor, torch.ops.aten.mul_.Scalar):
        return remat.CheckpointPolicy.MUST_SAVE
    return remat.CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("allow_mutation", [False, True])
def test_selective_policy_saving_an_in_place_op_on_a_view_matches_unchecked(allow_mutation: bool) -> None:
    x = torch.randn(3, 4, dtype=torch.float64)
    context_fn = functools.partial(
        remat.create_selective_checkpoint_contexts,
        _save_in_place_muls,
        allow_cache_entry_mutation=allow_mutation,
    )
    got = squared_loss_grads(lambda t: remat.checkpoint(_scale_a_slice, t, context_fn=context_fn), x, [])
    assert_same(got, squared_loss_grads(_scale_a_slice, x, []))


# Selective checkpointing on wrapper subclasses (torch's TwoTensor) and DTensor: the
# unchecked gradients, the same subclass out, and torch's SAC where this torch has it.

MM = torch.ops.aten.mm.default


def subclass_program(x: torch.Tensor, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention, a named tensor, and vector @ matrix (whose mm output gets ``squeeze_``)."""
    h = remat.name(attention_block(x, w) * 2, "scaled")
    return torch.matmul(v, h).sin()


def torch_sac_program(x: torch.Tensor, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Like ``subclass_program`` without vector @ matrix: torch's SAC calls matmul's
    own ``squeeze_`` a mutation of the cached mm output (false error, torch 2.13)."""
    return ((v[:, None] * attention_block(x, w)) @ w).sin()


SUBCLASS_POLICIES: dict[str, Callable[[], Any]] = {
    "mm list": lambda: [MM],
    "save_matmuls": lambda: P.save_matmuls,
    "save_only_names": lambda: P.save_only_names("scaled"),
}


def sac_grads(
    inputs: tuple[torch.Tensor, ...],
    policy: Any,
    make: Callable[..., Any] | None,
    program: Callable[..., torch.Tensor] = subclass_program,
) -> tuple[torch.Tensor, ...]:
    """Gradients of ``program``: unchecked (``make`` None) or under SAC."""
    leaves = tuple(t.detach().clone().requires_grad_() for t in inputs)
    if make is None:
        out = program(*leaves)
    else:
        context_fn = functools.partial(make, policy)
        checkpoint = (
            remat.checkpoint
            if make is remat.create_selective_checkpoint_contexts
            else tuc.checkpoint
        )
        out = checkpoint(program, *leaves, use_reentrant=False, context_fn=context_fn)
    return torch.autograd.grad(out.sum(), leaves)


@pytest.mark.parametrize("policy_name", sorted(SUBCLASS_POLICIES))
def test_sac_on_a_wrapper_subclass_matches_unchecked_and_torch(policy_name: str) -> None:
    two_tensor = two_tensor_class()
    torch.manual_seed(0)
    inputs = tuple(
        two_tensor(a.double(), (a * 3 - 1).double())
        for a in (torch.randn(5, 4), torch.randn(4, 4), torch.randn(5))
    )
    policy = SUBCLASS_POLICIES[policy_name]()
    with OpCounter() as ops:
        got = sac_grads(inputs, policy, remat.create_selective_checkpoint_contexts)
    want = sac_grads(inputs, policy, None)
    for g, r in zip(got, want, strict=True):
        assert type(g) is two_tensor
        assert torch.equal(g.a, r.a) and torch.equal(g.b, r.b)
    if policy_name != "save_only_names":
        assert ops.take()["aten.mm.default"] == 4 + 4 * 2  # forward + backward; none rerun
    if TORCH_SAC is not None and policy_name == "mm list":
        ours = sac_grads(
            inputs, policy, remat.create_selective_checkpoint_contexts, torch_sac_program
        )
        theirs = sac_grads(inputs, policy, TORCH_SAC, torch_sac_program)
        for g, t in zip(ours, theirs, strict=True):
            assert torch.equal(g.a, t.a) and torch.equal(g.b, t.b)


@pytest.mark.parametrize("policy_name", sorted(SUBCLASS_POLICIES))
def test_sac_on_dtensor_matches_unchecked_and_torch(
    one_process_mesh: Any, policy_name: str
) -> None:
    api = dtensor_api()
    torch.manual_seed(0)
    plain = (torch.randn(5, 4).double(), torch.randn(4, 4).double(), torch.randn(5).double())
    inputs = tuple(api.distribute_tensor(t, one_process_mesh, [api.Replicate()]) for t in plain)
    policy = SUBCLASS_POLICIES[policy_name]()
    try:
        want = sac_grads(inputs, policy, None)
    except (IndexError, NotImplementedError) as exc:  # torch 2.4: no mm/select on a 1-rank CPU mesh
        pytest.skip(f"this torch's DTensor cannot run the unchecked program: {exc!r}")
    got = sac_grads(inputs, policy, remat.create_selective_checkpoint_contexts)
    for g, r in zip(got, want, strict=True):
        assert isinstance(g, api.DTensor)
        assert torch.equal(g.to_local(), r.to_local())
    if TORCH_SAC is not None and policy_name == "mm list":
        ours = sac_grads(
            inputs, policy, remat.create_selective_checkpoint_contexts, torch_sac_program
        )
        theirs = sac_grads(inputs, policy, TORCH_SAC, torch_sac_program)
        for g, t in zip(ours, theirs, strict=True):
            assert torch.equal(g.to_local(), t.to_local())
