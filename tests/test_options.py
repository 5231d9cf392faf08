"""remat.CheckpointOptions: one value, validated once, the same from every front-end.

Every front-end reads ``context_fn`` the same way (None: no contexts; the factory without
its policy, or the contexts themselves: an error showing the fix) and leaves every call
keyword, even one named like an option, to the function.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

import remat
import remat.composable
import remat.nn
import remat.policies as P
from helpers import TORCH_SAC, OpCounter, assert_same, attention_block, grads
from remat.checkpoint import run_checkpoint
from remat.composable import checkpoint_module
from remat.errors import CheckpointTypeError, CheckpointUsageError
from remat.integrations.huggingface import RematCheckpointFunction
from remat.models import Block, GPTConfig
from remat.nn import checkpoint_wrapper
from remat.policies import save_matmuls, save_ops

MM = torch.ops.aten.mm.default


def test_defaults_and_normal_forms() -> None:
    assert remat.CheckpointOptions() == remat.CheckpointOptions(
        use_reentrant=None, context_fn=remat.noop_context_fn
    )
    assert remat.CheckpointOptions(context_fn=torch.utils.checkpoint.noop_context_fn).context_fn is None
    ops = (torch.ops.aten.mm.default,)
    # A list of ops is checked once and kept as the policy it means.
    listed = remat.CheckpointOptions(policy=ops)
    assert listed.policy == save_ops(torch.ops.aten.mm.default)
    assert listed == remat.CheckpointOptions(policy=[torch.ops.aten.mm.default])
    assert listed.replace(early_stop=False).policy == listed.policy


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"use_reentrant": "no"}, CheckpointTypeError, "use_reentrant"),
        ({"early_stop": 1}, CheckpointTypeError, "early_stop"),
        ({"preserve_rng_state": None}, CheckpointTypeError, "preserve_rng_state"),
        ({"debug": "yes"}, CheckpointTypeError, "debug"),
        ({"determinism_check": "never"}, CheckpointUsageError, "determinism_check"),
        ({"context_fn": 3}, CheckpointTypeError, "context_fn"),
        ({"context_fn": remat.create_selective_checkpoint_contexts}, CheckpointTypeError,
         "without its policy"),
        ({"policy": "save_matmuls"}, CheckpointTypeError, "policy"),
        ({"policy": [torch.ops.aten.mm]}, CheckpointUsageError, "OpOverloadPacket"),
        ({"policy": save_matmuls, "context_fn": lambda: (None, None)}, CheckpointUsageError,
         "not both"),
        ({"use_reentrant": True, "policy": save_matmuls}, CheckpointUsageError,
         "use_reentrant=False"),
        ({"use_reentrant": True, "debug": True}, CheckpointUsageError, "debug"),
    ],
)
def test_bad_values_name_the_api(fields: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match) as caught:
        remat.CheckpointOptions(**fields, api="my.front_end")
    assert str(caught.value).startswith("my.front_end: ")


def test_replace_validates_again() -> None:
    options = remat.CheckpointOptions(policy=save_matmuls)
    assert options.replace(early_stop=False).policy is save_matmuls
    with pytest.raises(CheckpointUsageError, match="use_reentrant=False"):
        options.replace(use_reentrant=True)


def test_a_list_policy_is_checked_once_and_the_engine_takes_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    import remat.policies

    checked: list[object] = []
    real = remat.policies.checked_ops

    def counting(ops: Any, api: str) -> frozenset[Any]:
        checked.append(api)
        return real(ops, api)

    monkeypatch.setattr(remat.policies, "checked_ops", counting)
    options = remat.CheckpointOptions(policy=[torch.ops.aten.mm.default], api="my.front_end")
    x = torch.randn(3, 3, requires_grad=True)
    run_checkpoint(options, lambda t: (t @ t).sin(), x).sum().backward()
    assert checked == ["my.front_end"]
    contexts = options.contexts()
    assert contexts is not None
    forward, _ = contexts()
    assert forward.policy is options.policy  # the normalised value, not a list
    # The torch-style spelling still takes a list, and says what is wrong with one.
    remat.create_selective_checkpoint_contexts([torch.ops.aten.mm.default])
    with pytest.raises(CheckpointUsageError, match=r"create_selective_checkpoint_contexts: .* OpOverloadPacket"):
        remat.create_selective_checkpoint_contexts([torch.ops.aten.mm])
    with pytest.raises(CheckpointTypeError, match="policy_fn_or_list must be"):
        remat.create_selective_checkpoint_contexts("mm")  # type: ignore[arg-type]


def test_from_kwargs_rejects_unknown_and_both_named() -> None:
    with pytest.raises(CheckpointUsageError, match=r"unknown checkpoint options \['speed'\]"):
        remat.CheckpointOptions.from_kwargs("api", {"speed": 2})
    with pytest.raises(CheckpointUsageError, match="not both"):
        remat.CheckpointOptions.from_kwargs(
            "api", {"policy": save_matmuls, "context_fn": remat.noop_context_fn}
        )


def _options_seen(monkeypatch: pytest.MonkeyPatch) -> list[remat.CheckpointOptions]:
    seen: list[remat.CheckpointOptions] = []
    original = run_checkpoint

    def spy(options: remat.CheckpointOptions, function: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(options)
        return original(options, function, *args, **kwargs)

    for module in ("remat.checkpoint", "remat.nn", "remat.composable",
                   "remat.integrations.huggingface"):
        # sys.modules: the name remat.checkpoint is also the function.
        monkeypatch.setattr(sys.modules[module], "run_checkpoint", spy)
    return seen


def test_every_front_end_builds_the_same_value(monkeypatch: pytest.MonkeyPatch) -> None:
    # The same options through every front-end reach the engine as equal values
    # (only the API named in messages differs).
    given = {"policy": save_matmuls, "early_stop": False, "determinism_check": "none"}
    expected = remat.CheckpointOptions(**given)  # type: ignore[arg-type]
    seen = _options_seen(monkeypatch)
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)

    remat.checkpoint(layer, x, **given)
    remat.checkpointed(layer, **given)(x)
    remat.checkpoint_wrapper(torch.nn.Linear(4, 4), **given)(x)
    RematCheckpointFunction(**given)(layer, x)
    # The composable form runs the engine through its hooks; under compile it
    # calls run_checkpoint like the others, so compare its stored value.
    module = remat.checkpoint_module(torch.nn.Linear(4, 4), **given)
    state = vars(module)["_remat_checkpoint_module"]

    assert [options == expected for options in seen] == [True] * 4
    assert state.options == expected
    assert [options.api for options in seen] == [
        "remat.checkpoint",
        "remat.checkpointed",
        "remat.nn.checkpoint_wrapper",
        "remat.integrations.huggingface",
    ]


def test_fixed_options_leave_every_call_keyword_to_the_function() -> None:
    def block(x: torch.Tensor, *, debug: bool, policy: str) -> torch.Tensor:
        return x.sin() if debug and policy == "p" else x.cos()

    x = torch.randn(3, requires_grad=True)
    run = functools.partial(run_checkpoint, remat.CheckpointOptions(early_stop=False))
    assert torch.equal(run(block, x, debug=True, policy="p"), x.sin())


# Call keywords named like an option reach the function: from checkpointed() and from
# the Hugging Face checkpoint function alike.


def test_call_arguments_named_like_options_reach_the_function() -> None:
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


def test_hugging_face_checkpoint_function_passes_layer_keywords_through() -> None:
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


# context_fn=None is torch's default (no contexts) on every front-end.


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
def test_context_fn_none_means_no_context(make: Callable[[torch.nn.Module], Any]) -> None:
    want, plain_ops, _ = block_grads(small_block())
    got, ops, _ = block_grads(make(small_block()))
    assert_same(got, want)
    assert plain_ops["ln"] == 0 and ops["ln"] == 2  # both layer norms recomputed in backward


def test_checkpoint_context_fn_none_matches_unchecked() -> None:
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    out = remat.checkpoint(attention_block, x, w, context_fn=None)
    got = torch.autograd.grad(out.sum(), (x, w))
    assert_same(got, torch.autograd.grad(attention_block(x, w).sum(), (x, w)))


# context_fn given the unbound factory, or the contexts themselves: an error showing
# the fix, on every front-end.


@pytest.mark.parametrize("factory", ["remat", "torch"])
@pytest.mark.parametrize(
    "front_end", ["checkpoint", "checkpointed", "checkpoint_module", "checkpoint_wrapper"]
)
def test_unbound_factory_as_context_fn_shows_the_partial_fix(
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


def test_contexts_instead_of_their_factory_says_so() -> None:
    x = torch.randn(3, requires_grad=True)
    pair = remat.create_selective_checkpoint_contexts([MM])
    with pytest.raises(
        CheckpointTypeError, match=r"got tuple\. It looks like the contexts themselves"
    ):
        remat.checkpoint(torch.sin, x, context_fn=pair)
