"""remat.name and the name-based policies: which ops rerun, exact gradients, errors."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import remat
import remat.memory
import remat.policies as P
from helpers import OpCounter
from remat._engine.frame import Frame
from remat.errors import CheckpointTypeError, CheckpointUsageError
from remat.models import GPT, Block, GPTConfig, lm_loss, make_batch

ADDMM = "aten.addmm.default"
SDPA_CPU = "aten._scaled_dot_product_flash_attention_for_cpu.default"


def grads_of(fn: Callable[..., torch.Tensor], *leaves: torch.Tensor, params: list[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], Any]:
    out = fn(*leaves)
    with OpCounter() as ops:
        grads = torch.autograd.grad(out.sum(), [*leaves, *params])
    return grads, ops.take()


def assert_equal(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_name_returns_the_tensor_itself() -> None:
    x = torch.randn(3, requires_grad=True)
    h = x.sin()
    assert remat.name(h, "h") is h
    assert remat.name(h, "h").grad_fn is h.grad_fn


def test_name_is_an_op_whenever_a_dispatch_mode_could_see_it() -> None:
    # Plain eager code skips the operator (nothing could see it); any dispatch
    # mode, a user's own included, must still see it, as a selective region's does.
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[Any] = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x = torch.randn(3, requires_grad=True)
    with Spy():
        h = x.sin()
        assert remat.name(h, "h") is h
    assert remat.names.NAMED_OP in seen


def test_name_is_visible_to_policies_as_an_op() -> None:
    seen: list[tuple[Any, Any]] = []

    def spy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
        seen.append((op, remat.names.tensor_name(op, args)))
        return False

    x = torch.randn(4, requires_grad=True)
    remat.checkpoint(lambda t: remat.name(t.exp(), "e").sin(), x, policy=spy).sum().backward()
    assert (remat.names.NAMED_OP, "e") in seen


@pytest.mark.parametrize("bad", [None, 3, ""])
def test_name_rejects_bad_labels(bad: Any) -> None:
    with pytest.raises((CheckpointTypeError, CheckpointUsageError), match=r"remat\.name"):
        remat.name(torch.randn(2), bad)


def test_name_rejects_non_tensors() -> None:
    with pytest.raises(CheckpointTypeError, match="expected a tensor"):
        remat.name([1, 2], "x")  # type: ignore[arg-type]


@pytest.mark.parametrize("maker", [P.save_only_names, P.save_all_but_names, P.offload_names])
def test_name_policies_need_string_names(maker: Callable[..., Any]) -> None:
    with pytest.raises(CheckpointUsageError, match="at least one name"):
        maker()
    with pytest.raises(CheckpointTypeError, match="non-empty strings"):
        maker(["attn_out"])


def _mlp() -> tuple[torch.nn.Linear, torch.nn.Linear, Callable[[torch.Tensor], torch.Tensor]]:
    torch.manual_seed(0)
    up, down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def block(x: torch.Tensor) -> torch.Tensor:
        hidden = remat.name(up(x), "hidden")
        return remat.name(down(hidden.relu()), "out").tanh()

    return up, down, block


@pytest.mark.parametrize(
    ("policy", "addmm_reruns"),
    [
        (None, 2),  # plain checkpoint: both linears rerun
        (P.save_only_names("hidden"), 1),  # up's output replayed, down reruns
        (P.save_only_names("hidden", "out"), 0),
        (P.save_all_but_names("hidden"), 1),
        (P.offload_names("hidden", "out"), 0),
        (P.first_of(P.save_only_names("hidden"), P.save_matmuls), 0),
    ],
)
def test_named_producers_are_replayed_not_rerun(policy: Any, addmm_reruns: int) -> None:
    up, down, block = _mlp()
    x = torch.randn(4, 8, requires_grad=True)
    params = [up.weight, down.weight]
    want, _ = grads_of(block, x, params=params)
    got, ops = grads_of(lambda t: remat.checkpoint(block, t, policy=policy), x, params=params)
    assert_equal(got, want)
    assert ops[ADDMM] == addmm_reruns


def test_name_after_in_place_change_keeps_the_named_value() -> None:
    # The producer's output was changed in place before naming: the producer
    # must rerun (its cached value would be the changed one) and the result stays exact.
    w = torch.randn(5, 5, requires_grad=True)

    def block(x: torch.Tensor) -> torch.Tensor:
        h = x @ w
        h.mul_(2)
        return remat.name(h, "h").sin() * x

    x = torch.randn(5, 5, requires_grad=True)
    want, _ = grads_of(block, x, params=[w])
    got, ops = grads_of(lambda t: remat.checkpoint(block, t, policy=P.save_only_names("h")), x, params=[w])
    assert_equal(got, want)
    assert ops["aten.mm.default"] == 3  # the producer reran (+ two backward matmuls)


def test_name_of_a_view_reaches_the_producer() -> None:
    w = torch.randn(6, 6, requires_grad=True)

    def block(x: torch.Tensor) -> torch.Tensor:
        return remat.name((x @ w).t(), "ht").exp()

    x = torch.randn(6, 6, requires_grad=True)
    want, _ = grads_of(block, x, params=[w])
    got, ops = grads_of(lambda t: remat.checkpoint(block, t, policy=P.save_only_names("ht")), x, params=[w])
    assert_equal(got, want)
    assert ops["aten.mm.default"] == 2  # the two backward matmuls; the forward mm is replayed



def test_name_of_a_matmul_returned_through_unsafe_view_reaches_the_matmul() -> None:
    # A bias-free Linear on a 3-D input (every Llama projection) is mm, then
    # _unsafe_view: an alias that is no view op. The name reached _unsafe_view,
    # and the mm was silently rerun.
    torch.manual_seed(0)
    proj = torch.nn.Linear(8, 8, bias=False)

    def block(x: torch.Tensor) -> torch.Tensor:
        return remat.name(proj(x.sin()), "out").cos()

    x = torch.randn(2, 4, 8, requires_grad=True)
    want, _ = grads_of(block, x, params=[proj.weight])
    policy = P.save_only_names("out")
    got, ops = grads_of(lambda t: remat.checkpoint(block, t, policy=policy), x, params=[proj.weight])
    assert_equal(got, want)
    assert ops["aten.mm.default"] == 2  # the two backward matmuls; the forward mm is replayed

def test_names_survive_nesting_and_decorators() -> None:
    w = torch.randn(6, 6, requires_grad=True)

    @remat.checkpointed
    def inner(t: torch.Tensor) -> torch.Tensor:
        return remat.name(t @ w, "inner_mm").sigmoid()

    def outer(t: torch.Tensor) -> torch.Tensor:
        return inner(t.cos()).exp()

    x = torch.randn(6, 6, requires_grad=True)
    want, _ = grads_of(outer, x, params=[w])
    got, _ = grads_of(
        lambda t: remat.checkpoint(outer, t, policy=P.save_only_names("inner_mm")), x, params=[w]
    )
    assert_equal(got, want)


def _block_and_input() -> tuple[Block, torch.Tensor]:
    torch.manual_seed(0)
    config = GPTConfig(n_layers=1, seq_len=16, d_model=32, n_heads=2, d_ff=64)
    return Block(config), torch.randn(2, 16, 32, requires_grad=True)


@pytest.mark.parametrize(
    ("policy", "linear_reruns", "attention_reruns"),
    [
        # Early stop: the MLP's last linear is never rerun (nothing after it is saved).
        (P.save_nothing, 3, 1),
        (P.save_matmuls, 0, 0),
        (P.save_matmuls_without_batch_dims, 0, 1),
        (P.save_only_names("attn_out"), 3, 0),
        (P.save_only_names("attn_out", "mlp_out"), 3, 0),
        (P.save_all_but_names("attn_out"), 3, 1),
        (P.offload_names("attn_out"), 3, 0),
    ],
)
def test_each_builtin_policy_on_a_transformer_block(
    policy: Any, linear_reruns: int, attention_reruns: int
) -> None:
    block, x = _block_and_input()
    params = list(block.parameters())
    want, _ = grads_of(block, x, params=params)
    got, ops = grads_of(lambda t: remat.checkpoint(block, t, policy=policy), x, params=params)
    assert_equal(got, want)
    assert ops[ADDMM] == linear_reruns  # of qkv, proj, mlp up, mlp down
    assert ops[SDPA_CPU] == attention_reruns


def test_selective_regions_do_not_leak_frames() -> None:
    block, x = _block_and_input()
    for policy in (P.save_matmuls, P.save_only_names("attn_out"), P.offload_names("attn_out")):
        remat.checkpoint(block, x, policy=policy).sum().backward()
    gc.collect()
    assert not [obj for obj in gc.get_objects() if type(obj) is Frame]


def test_savings_ladder_on_the_embedded_model() -> None:
    """End-of-forward bytes: full checkpoint < names < matmuls < none."""
    config = GPTConfig(n_layers=2, seq_len=32, d_model=32, n_heads=2, d_ff=64)
    idx, targets = make_batch(config, 2, torch.Generator().manual_seed(0))

    def forward_bytes(policy: Any) -> int:
        torch.manual_seed(0)
        model = GPT(config)
        fn = None if policy == "none" else (lambda b, h: remat.checkpoint(b, h, policy=policy))
        with remat.memory.track() as tracker:
            loss = lm_loss(model(idx, checkpoint_fn=fn), targets)
            tracker.mark("forward_end")
        loss.backward()
        return tracker.marks["forward_end"]

    ladder = [forward_bytes(p) for p in (P.save_nothing, P.save_only_names("attn_out"), P.save_matmuls, "none")]
    assert ladder == sorted(ladder) and len(set(ladder)) == 4, ladder


_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "mm": lambda h, w: h @ w,
    "sin": lambda h, w: h.sin(),
    "mul": lambda h, w: h * w,
    "tanh": lambda h, w: h.tanh(),
    "view": lambda h, w: h.t().contiguous().t(),
}
_NAMES = ("a", "b", "c")


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.sampled_from(sorted(_OPS)), st.sampled_from((None, *_NAMES))), min_size=1, max_size=6
    ),
    chosen=st.sets(st.sampled_from(_NAMES), min_size=1),
    kind=st.sampled_from(["save_only", "save_all_but", "offload", "first_of_matmuls"]),
    nested=st.booleans(),
)
def test_random_named_programs_match_unchecked(
    steps: list[tuple[str, str | None]], chosen: set[str], kind: str, nested: bool
) -> None:
    names = sorted(chosen)
    policy = {
        "save_only": lambda: P.save_only_names(*names),
        "save_all_but": lambda: P.save_all_but_names(*names),
        "offload": lambda: P.offload_names(*names),
        "first_of_matmuls": lambda: P.first_of(P.offload_names(*names), P.save_matmuls),
    }[kind]()
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)

    def program(h: torch.Tensor) -> torch.Tensor:
        for index, (op, label) in enumerate(steps):
            h = _OPS[op](h, w)
            if label is not None:
                h = remat.name(h, label)
            if nested and index == 0:
                h = remat.checkpoint(torch.sigmoid, h)
        return h * w

    x = torch.randn(4, 4, requires_grad=True)
    want, _ = grads_of(program, x, params=[w])
    got, _ = grads_of(lambda t: remat.checkpoint(program, t, policy=policy), x, params=[w])
    assert_equal(got, want)


def test_policies_copy_and_pickle_as_values() -> None:
    import copy
    import pickle

    from remat import policies

    built = [
        policies.save_nothing,
        policies.save_matmuls,
        policies.save_matmuls_without_batch_dims,
        policies.save_ops(torch.ops.aten.mm.default, torch.ops.aten.sin.default),
        policies.save_only_names("a"),
        policies.save_all_but_names("b"),
        policies.first_of(policies.save_only_names("a"), policies.save_matmuls),
        policies.save_any_of(policies.save_matmuls, policies.save_only_names("a")),
    ]
    for policy in built:
        assert copy.deepcopy(policy) is policy and copy.copy(policy) is policy
        twin = pickle.loads(pickle.dumps(policy))
        assert twin == policy, policy
    # A wrapper holding a policy deep-copies (a model copy must not fail on it).
    block = remat.nn.checkpoint_wrapper(torch.nn.Linear(4, 4), policy=policies.save_matmuls)
    twin_block = copy.deepcopy(block)
    x = torch.randn(2, 4)
    assert torch.equal(twin_block(x), block(x))
