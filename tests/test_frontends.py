"""Front-end regressions of issue 13 (items 7-11, 13): each test names its item.

Oracles: the same program run without checkpointing (bitwise on CPU), and
torch's own selective checkpointing where the torch version has it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as tuc

import remat
import remat.policies as P
from helpers import OpCounter, assert_same, dtensor_api, grads, two_tensor_class
from remat.composable import checkpoint_module
from remat.errors import CheckpointTypeError, PolicyError
from remat.models import Block, GPTConfig
from remat.nn import checkpoint_wrapper

MM = torch.ops.aten.mm.default
TORCH_SAC = getattr(tuc, "create_selective_checkpoint_contexts", None)  # torch >= 2.5


def attention_block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Self-attention with a residual and a norm, written with operators (``@``, ``+``)."""
    q = x @ w
    scores = (q @ x.transpose(-1, -2)).softmax(-1)
    return torch.nn.functional.layer_norm(x + scores @ q, x.shape[-1:])


# --- item 7: SAC on wrapper subclasses and DTensor -------------------------------------


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
def test_item7_sac_on_a_wrapper_subclass_matches_unchecked_and_torch(policy_name: str) -> None:
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
def test_item7_sac_on_dtensor_matches_unchecked_and_torch(
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


# --- item 10: a bad policy is a PolicyError, never "unsupported operand" -----------------


def _returns_none(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    return None


def _returns_string(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    return "save"


def _wrong_signature(op: Any) -> bool:
    return True


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (_returns_none, r"_returns_none returned None for op aten\.mm\.default"),
        (_returns_string, r"_returns_string returned 'save' for op aten\.mm\.default"),
        (_wrong_signature, r"_wrong_signature raised TypeError for op aten\.mm\.default.*takes 1"),
        (P.first_of(_returns_none), r"_returns_none returned None"),
    ],
)
@pytest.mark.parametrize("via", ["policy", "context_fn"])
def test_item10_bad_policy_under_an_operator_names_policy_op_and_value(
    policy: Any, expected: str, via: str
) -> None:
    x = torch.randn(4, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    options: dict[str, Any] = (
        {"policy": policy}
        if via == "policy"
        else {"context_fn": functools.partial(remat.create_selective_checkpoint_contexts, policy)}
    )
    with pytest.raises(PolicyError, match=expected) as info:
        remat.checkpoint(attention_block, x, w, **options)
    assert not isinstance(info.value, TypeError)  # a TypeError would become "unsupported operand"
    assert info.value.op is MM
    assert "policy(ctx, op, *args, **kwargs)" in str(info.value)
    # The failed region left nothing behind: the same program then runs and matches.
    out = remat.checkpoint(attention_block, x, w, policy=P.save_matmuls)
    got = torch.autograd.grad(out.sum(), (x, w))
    want = torch.autograd.grad(attention_block(x, w).sum(), (x, w))
    assert all(torch.equal(g, r) for g, r in zip(got, want, strict=True))


@pytest.mark.parametrize("combine", [P.first_of, P.save_any_of])
def test_item10_combinator_of_a_non_callable_fails_when_built(combine: Any) -> None:
    with pytest.raises(
        CheckpointTypeError, match=r"every policy must be callable.*policy 1 is str"
    ):
        combine(P.save_matmuls, "save")


def test_item10_policy_error_names_a_builtin_policy_by_its_reason() -> None:
    class Undecided(P.Policy):
        def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            return None

    x = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(
        PolicyError, match=r"policy Undecided\('never decides'\) returned None"
    ) as info:
        remat.checkpoint(lambda t: t @ t, x, policy=Undecided(reason="never decides"))
    assert len(str(info.value)) < 400


# --- item 8: checkpoint_module(module, context_fn=None), torch's composable default ------


def small_block() -> torch.nn.Module:
    torch.manual_seed(0)
    return Block(GPTConfig(vocab_size=16, seq_len=6, d_model=16, n_heads=2, n_layers=1)).double()


def block_grads(block: torch.nn.Module) -> tuple[Any, dict[str, Any], Any]:
    torch.manual_seed(1)
    x = torch.randn(2, 6, 16, dtype=torch.float64, requires_grad=True)
    out = block(x)
    with OpCounter() as ops:
        out.pow(2).sum().backward()
    return (out, x.grad, grads(block)), {"ln": ops.take()["aten.native_layer_norm.default"]}, block


@pytest.mark.parametrize(
    "make",
    [
        lambda m: checkpoint_module(m, context_fn=None),
        lambda m: checkpoint_module(m, context_fn=None, policy=P.save_matmuls),
        lambda m: checkpoint_wrapper(m, context_fn=None),
    ],
    ids=["composable", "composable+policy", "wrapper"],
)
def test_item8_context_fn_none_means_no_context(make: Callable[[torch.nn.Module], Any]) -> None:
    want, plain_ops, _ = block_grads(small_block())
    got, ops, _ = block_grads(make(small_block()))
    assert_same(got, want)
    assert plain_ops["ln"] == 0 and ops["ln"] == 2  # both layer norms recomputed in backward


def test_item8_checkpoint_context_fn_none_matches_unchecked() -> None:
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    out = remat.checkpoint(attention_block, x, w, context_fn=None)
    got = torch.autograd.grad(out.sum(), (x, w))
    assert_same(got, torch.autograd.grad(attention_block(x, w).sum(), (x, w)))


# --- item 9: checkpointed() passes every call argument to the function ------------------


def test_item9_call_arguments_named_like_options_reach_the_function() -> None:
    seen: dict[str, Any] = {}

    @remat.checkpointed(policy=[MM])
    def block(x: torch.Tensor, w: torch.Tensor, **flags: Any) -> torch.Tensor:
        seen.update(flags)
        return attention_block(x, w) * flags["scale"]

    flags = {
        "debug": "mine",
        "determinism_check": "also mine",
        "context_fn": None,
        "policy": "not a policy",
        "early_stop": 0,
        "preserve_rng_state": "x",
        "use_reentrant": "y",
    }
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    scale = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    out = block(x, w, scale=scale, **flags)
    assert seen == {**flags, "scale": scale}
    with OpCounter() as ops:
        got = torch.autograd.grad(out.sum(), (x, w, scale))
    assert ops.take()["aten.mm.default"] == 2 * 3  # backward only: policy=[MM] still applies
    want = torch.autograd.grad((attention_block(x, w) * scale).sum(), (x, w, scale))
    assert_same(got, want)


def test_item9_hugging_face_checkpoint_function_passes_layer_keywords_through() -> None:
    from remat.integrations.huggingface import RematCheckpointFunction

    seen: dict[str, Any] = {}

    def layer(x: torch.Tensor, w: torch.Tensor, **flags: Any) -> torch.Tensor:
        seen.update(flags)
        return attention_block(x, w)

    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    run = RematCheckpointFunction(policy=[MM], debug=False)
    out = run(layer, x, w, debug="layer's own", preserve_rng_state="also the layer's")
    assert seen == {"debug": "layer's own", "preserve_rng_state": "also the layer's"}
    with OpCounter() as ops:
        got = torch.autograd.grad(out.sum(), (x, w))
    assert ops.take()["aten.mm.default"] == 2 * 3  # policy=[MM] applied: no mm rerun
    assert_same(got, torch.autograd.grad(attention_block(x, w).sum(), (x, w)))


# --- item 11: context_fn=create_selective_checkpoint_contexts, unbound -------------------


@pytest.mark.parametrize("factory", ["remat", "torch"])
@pytest.mark.parametrize(
    "front_end", ["checkpoint", "checkpointed", "checkpoint_module", "checkpoint_wrapper"]
)
def test_item11_unbound_factory_as_context_fn_shows_the_partial_fix(
    factory: str, front_end: str
) -> None:
    make = remat.create_selective_checkpoint_contexts if factory == "remat" else TORCH_SAC
    if make is None:
        pytest.skip(
            "torch.utils.checkpoint has no create_selective_checkpoint_contexts in this torch"
        )
    x = torch.randn(5, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    calls: dict[str, Callable[[], Any]] = {
        "checkpoint": lambda: remat.checkpoint(attention_block, x, w, context_fn=make),
        "checkpointed": lambda: remat.checkpointed(attention_block, context_fn=make),
        "checkpoint_module": lambda: checkpoint_module(small_block(), context_fn=make),
        "checkpoint_wrapper": lambda: checkpoint_wrapper(small_block(), context_fn=make),
    }
    with pytest.raises(
        CheckpointTypeError,
        match=r"without its policy.*functools\.partial\(create_selective_checkpoint_contexts, policy\)",
    ):
        calls[front_end]()


def test_item11_contexts_instead_of_their_factory_says_so() -> None:
    x = torch.randn(3, requires_grad=True)
    pair = remat.create_selective_checkpoint_contexts([MM])
    with pytest.raises(
        CheckpointTypeError, match=r"got tuple\. It looks like the contexts themselves"
    ):
        remat.checkpoint(torch.sin, x, context_fn=pair)


# --- item 13: checkpoint_sequential says what it accepts ---------------------------------


def test_item13_single_module_is_a_clear_type_error() -> None:
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(
        CheckpointTypeError,
        match=r"nn\.Sequential, or a list, tuple or nn\.ModuleList of callables.*got Linear\. "
        r"To checkpoint one Linear, call remat\.checkpoint",
    ):
        remat.checkpoint_sequential(torch.nn.Linear(4, 4), 1, x)
    with pytest.raises(CheckpointTypeError, match=r"element 1 is int, not callable"):
        remat.checkpoint_sequential([torch.nn.Linear(4, 4), 3], 1, x)


@pytest.mark.parametrize("container", [list, tuple, torch.nn.ModuleList])
def test_item13_accepted_containers_match_unchecked(container: Callable[[Any], Any]) -> None:
    torch.manual_seed(0)
    layers = [
        torch.nn.Linear(4, 4).double(),
        torch.nn.LayerNorm(4).double(),
        torch.nn.GELU(),
        torch.nn.Linear(4, 4).double(),
    ]
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    out = remat.checkpoint_sequential(container(layers), 2, x)
    params = [p for layer in layers for p in layer.parameters()]
    got = torch.autograd.grad(out.sum(), (x, *params))
    want_out = x
    for layer in layers:
        want_out = layer(want_out)
    assert_same(got, torch.autograd.grad(want_out.sum(), (x, *params)))
