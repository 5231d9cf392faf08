"""remat.CheckpointOptions: one value, validated once, the same from every front-end."""

from __future__ import annotations

import functools
import sys
from typing import Any

import pytest
import torch

import remat
import remat.composable
import remat.nn
from remat.checkpoint import run_checkpoint
from remat.errors import CheckpointTypeError, CheckpointUsageError
from remat.integrations.huggingface import RematCheckpointFunction
from remat.policies import save_matmuls, save_ops


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
