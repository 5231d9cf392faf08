"""Module wrappers (remat.nn), differential against torch's checkpoint_wrapper."""

from __future__ import annotations

import copy
import functools
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as tw
import torch.utils.checkpoint as tuc
from torch import nn
from torch.distributed.fsdp.wrap import (
    ModuleWrapPolicy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
)

import remat
from helpers import CallCounter, OpCounter, assert_same, grads
from remat.errors import CheckpointTypeError, CheckpointUsageError
from remat.memory import track
from remat.models import GPT, Block, GPTConfig
from remat.nn import (
    ActivationWrapper,
    CheckpointImpl,
    CheckpointWrapper,
    OffloadWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    every_nth,
    offload_wrapper,
)
from remat.policies import save_matmuls

IMPLS = ["NO_REENTRANT", "REENTRANT"]


class MLP(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.norm = nn.BatchNorm1d(2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.norm(self.up(x))))


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), MLP(), nn.Tanh(), MLP(), nn.Linear(8, 4))


def run(model: nn.Module, seed: int = 1) -> tuple[torch.Tensor, dict[str, Any], torch.Tensor]:
    torch.manual_seed(seed)
    x = torch.randn(6, 8, requires_grad=True)
    out = model(x)
    out.pow(2).sum().backward()
    named = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in grads(model).items()}
    return out, dict(sorted(named.items())), x.grad


def structure(model: nn.Module) -> list[tuple[str, str]]:
    return [(name, type(module).__name__) for name, module in model.named_modules()]


def wrap_mlps(model: nn.Sequential, wrapper: Callable[[nn.Module], nn.Module]) -> nn.Sequential:
    for index in (1, 3):
        model[index] = wrapper(model[index])
    return model


# --- differential: same outputs, gradients and names as torch's wrapper -------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_outputs_and_grads_equal_torch_wrapper_and_plain(impl: str) -> None:
    plain = run(make_model())
    ours = run(
        wrap_mlps(
            make_model(),
            functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl[impl]),
        )
    )
    theirs = run(
        wrap_mlps(
            make_model(),
            functools.partial(tw.checkpoint_wrapper, checkpoint_impl=tw.CheckpointImpl[impl]),
        )
    )
    assert_same(ours, plain)
    assert_same(ours, theirs)


def test_names_match_torch_wrapper() -> None:
    ours = wrap_mlps(make_model(), checkpoint_wrapper)
    theirs = wrap_mlps(make_model(), tw.checkpoint_wrapper)
    plain = make_model()
    assert list(ours.state_dict()) == list(theirs.state_dict()) == list(plain.state_dict())
    # Root-level names carry the wrapper component, as in torch (it is a real submodule).
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert structure(ours) == structure(theirs)
    # On the wrapper itself, parameter names are those of the wrapped module.
    assert [n for n, _ in ours[1].named_parameters()] == [
        n for n, _ in theirs[1].named_parameters()
    ]
    assert [n for n, _ in ours[1].named_parameters()] == [n for n, _ in plain[1].named_parameters()]
    # Buffers too (torch keeps the prefix there; remat hides it like for parameters).
    assert [n for n, _ in ours[1].named_buffers()] == [n for n, _ in plain[1].named_buffers()]


def test_state_dict_round_trips_both_directions_strict() -> None:
    wrapped = wrap_mlps(make_model(), checkpoint_wrapper)
    with torch.no_grad():
        for parameter in wrapped.parameters():
            parameter.add_(1.0)
    plain = make_model()
    plain.load_state_dict(wrapped.state_dict(), strict=True)
    assert_same(dict(plain.state_dict()), dict(wrapped.state_dict()))
    fresh = wrap_mlps(make_model(), checkpoint_wrapper)
    fresh.load_state_dict(plain.state_dict(), strict=True)
    assert_same(dict(fresh.state_dict()), dict(wrapped.state_dict()))
    # And across libraries: torch's wrapped model <-> remat's wrapped model.
    theirs = wrap_mlps(make_model(), tw.checkpoint_wrapper)
    theirs.load_state_dict(wrapped.state_dict(), strict=True)
    fresh.load_state_dict(theirs.state_dict(), strict=True)
    assert_same(dict(fresh.state_dict()), dict(wrapped.state_dict()))


def test_state_dict_keeps_module_version_metadata() -> None:
    wrapped = wrap_mlps(make_model(), checkpoint_wrapper)
    metadata = wrapped.state_dict()._metadata  # type: ignore[attr-defined]
    assert metadata["1.norm"] == make_model().state_dict()._metadata["1.norm"]  # type: ignore[attr-defined]
    assert not any("_checkpoint_wrapped_module" in key for key in metadata)


def test_load_errors_name_the_user_keys() -> None:
    wrapped = wrap_mlps(make_model(), checkpoint_wrapper)
    state = make_model().state_dict()
    del state["1.up.weight"]
    state["1.extra"] = torch.zeros(1)
    result = wrapped.load_state_dict(state, strict=False)
    assert result.missing_keys == ["1.up.weight"]
    assert result.unexpected_keys == ["1.extra"]
    with pytest.raises(RuntimeError, match=r'"1\.up\.weight"'):
        wrapped.load_state_dict(state)


def test_nested_wrappers_keep_names_and_gradients() -> None:
    nested = wrap_mlps(
        make_model(), lambda m: offload_wrapper(checkpoint_wrapper(checkpoint_wrapper(m)))
    )
    plain = make_model()
    assert list(nested.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in nested[1].named_parameters()] == [
        n for n, _ in plain[1].named_parameters()
    ]
    plain.load_state_dict(nested.state_dict())
    nested.load_state_dict(plain.state_dict())
    assert_same(run(nested), run(plain))


def test_attributes_and_indexing_reach_the_inner_module() -> None:
    inner = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    wrapped = checkpoint_wrapper(inner)
    assert wrapped[0] is inner[0]
    assert wrapped[0].in_features == 3
    assert wrapped._checkpoint_wrapped_module is inner
    assert [type(m) for m in wrapped] == [nn.Linear, nn.ReLU]
    with pytest.raises(AttributeError):
        _ = wrapped.no_such_attribute


def test_deepcopy_and_pickle_of_a_wrapped_model() -> None:
    wrapped = wrap_mlps(make_model(), checkpoint_wrapper)
    expected = run(copy.deepcopy(wrapped))
    assert_same(run(copy.deepcopy(wrapped)), expected)
    assert_same(run(pickle.loads(pickle.dumps(wrapped))), expected)


# --- checkpoint options, calls and recomputation ------------------------------------------


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(
        self, x: torch.Tensor, *, shift: torch.Tensor, scale: float = 1.0, debug: bool = False
    ) -> torch.Tensor:
        out = self.linear(x).sin() * scale + shift
        return out * 2 if debug else out


@pytest.mark.parametrize("impl", IMPLS)
def test_keyword_arguments_reach_the_module_and_get_gradients(impl: str) -> None:
    def step(module: nn.Module) -> tuple[Any, ...]:
        torch.manual_seed(3)
        x = torch.randn(2, 4, requires_grad=True)
        shift = torch.randn(4, requires_grad=True)
        out = module(x, shift=shift, scale=3.0, debug=True)
        out.sum().backward()
        return out, x.grad, shift.grad, grads(module)

    torch.manual_seed(0)
    plain = Scaled()
    ours = checkpoint_wrapper(copy.deepcopy(plain), CheckpointImpl[impl])
    # ``debug`` is also a checkpoint option: it must reach the module, not checkpoint().
    assert_same(step(ours), step(plain))
    if impl == "REENTRANT":  # torch handles kwargs for reentrant too
        theirs = tw.checkpoint_wrapper(copy.deepcopy(plain), tw.CheckpointImpl.REENTRANT)
        out, x_grad, shift_grad, _ = step(theirs)
        assert_same((out, x_grad, shift_grad), step(ours)[:3])


@pytest.mark.parametrize("impl", IMPLS)
def test_module_forward_reruns_exactly_once_in_backward(impl: str) -> None:
    inner = MLP()
    counter = CallCounter(inner.forward)
    inner.forward = counter  # type: ignore[method-assign]
    wrapped = checkpoint_wrapper(inner, CheckpointImpl[impl])
    x = torch.randn(4, 8, requires_grad=True)
    out = wrapped(x)
    assert counter.calls == 1
    out.sum().backward()
    assert counter.calls == 2


def test_options_flow_through_to_checkpoint() -> None:
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)

    def backward_matmuls(module: nn.Module) -> int:
        out = module(x)
        with OpCounter() as counter:
            out.sum().backward()
        return counter.counts["aten.addmm.default"]  # backward itself uses mm only

    # The first Linear reruns (early stop skips the last one: its output is not saved).
    assert backward_matmuls(checkpoint_wrapper(layer)) == 1
    assert backward_matmuls(checkpoint_wrapper(layer, policy=save_matmuls)) == 0
    assert backward_matmuls(checkpoint_wrapper(layer, early_stop=False)) == 2
    # determinism_check / debug reach the engine: a function that differs on recompute.
    flips = iter([1.0, 2.0])

    class Changing(nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return t.expand(2, *t.shape).exp() if next(flips) == 1.0 else t.exp()

    out = checkpoint_wrapper(Changing(), debug=True)(x)
    with pytest.raises(remat.CheckpointError):
        out.sum().backward()


def test_custom_checkpoint_fn_is_used_with_its_options() -> None:
    wrapped = wrap_mlps(
        make_model(),
        functools.partial(checkpoint_wrapper, checkpoint_fn=tuc.checkpoint, use_reentrant=False),
    )
    assert isinstance(wrapped[1], CheckpointWrapper)
    assert wrapped[1].checkpoint_fn.func is tuc.checkpoint
    assert_same(run(wrapped), run(make_model()))


def test_torch_checkpoint_impl_members_are_accepted() -> None:
    wrapped = checkpoint_wrapper(MLP(), tw.CheckpointImpl.REENTRANT)
    assert wrapped.checkpoint_impl is CheckpointImpl.REENTRANT


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda: checkpoint_wrapper(lambda x: x), CheckpointTypeError),  # type: ignore[arg-type]
        (lambda: checkpoint_wrapper(MLP(), "NO_REENTRANT"), CheckpointTypeError),  # type: ignore[arg-type]
        (lambda: checkpoint_wrapper(MLP(), checkpoint_fn=3), CheckpointTypeError),  # type: ignore[arg-type]
        (lambda: checkpoint_wrapper(MLP(), no_such_option=1), CheckpointUsageError),
        (lambda: checkpoint_wrapper(MLP(), use_reentrant=True), CheckpointUsageError),
        (lambda: checkpoint_wrapper(MLP(), determinism_check="sometimes"), CheckpointUsageError),
        (lambda: checkpoint_wrapper(MLP(), context_fn=5), CheckpointTypeError),
        (
            lambda: checkpoint_wrapper(MLP(), CheckpointImpl.REENTRANT, policy=save_matmuls),
            CheckpointUsageError,
        ),
        (
            lambda: checkpoint_wrapper(
                MLP(), policy=save_matmuls, context_fn=remat.noop_context_fn
            ),
            CheckpointUsageError,
        ),
        (lambda: offload_wrapper(42), CheckpointTypeError),  # type: ignore[arg-type]
        (lambda: offload_wrapper(MLP(), min_bytes=-1), CheckpointUsageError),
    ],
)
def test_bad_input_is_refused_when_wrapping(
    call: Callable[[], Any], error: type[Exception]
) -> None:
    with pytest.raises(error, match="remat"):
        call()


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_reentrant_wrapper_keeps_torch_error_for_no_grad_output() -> None:
    wrapped = checkpoint_wrapper(nn.Identity(), CheckpointImpl.REENTRANT)
    theirs = tw.checkpoint_wrapper(nn.Identity(), tw.CheckpointImpl.REENTRANT)
    x = torch.randn(3)  # nothing requires grad: reentrant backward has nothing to do
    for module in (wrapped, theirs):
        with pytest.raises(RuntimeError):
            module(x).sum().backward()


# --- memory ------------------------------------------------------------------------------


def test_end_of_forward_bytes_equal_function_checkpoint() -> None:
    torch.manual_seed(0)
    block = Block(GPTConfig(n_layers=1, seq_len=32))
    x = torch.randn(2, 32, 128, requires_grad=True)

    def forward_bytes(call: Callable[[torch.Tensor], torch.Tensor]) -> tuple[int, int]:
        block.zero_grad(set_to_none=True)
        with track() as tracker:
            out = call(x)
            tracker.mark("forward_end")
            out.sum().backward()
        return tracker.marks["forward_end"], tracker.peak_bytes

    wrapper_bytes = forward_bytes(checkpoint_wrapper(block))
    function_bytes = forward_bytes(lambda t: remat.checkpoint(block, t))
    plain_bytes = forward_bytes(block)
    assert wrapper_bytes == function_bytes
    assert wrapper_bytes[0] < plain_bytes[0] / 4  # only the output and the input's anchor stay


# --- offload ------------------------------------------------------------------------------


class SavesInput(torch.autograd.Function):
    """Identity that records which storage backward gets back for its saved input."""

    seen: list[int] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        SavesInput.seen.append(x.untyped_storage().data_ptr())
        return grad


def test_offload_wrapper_gradients_bit_identical_and_tensors_leave_the_device() -> None:
    plain = run(make_model())
    assert_same(run(wrap_mlps(make_model(), offload_wrapper)), plain)
    assert_same(
        run(wrap_mlps(make_model(), lambda m: offload_wrapper(checkpoint_wrapper(m)))), plain
    )

    class Holder(nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return SavesInput.apply(t)  # type: ignore[no-any-return]

    x = torch.randn(64, 64, requires_grad=True)
    SavesInput.seen.clear()
    Holder()(x).sum().backward()
    offload_wrapper(Holder())(x).sum().backward()
    kept, offloaded = SavesInput.seen
    assert kept == x.untyped_storage().data_ptr()
    assert offloaded != x.untyped_storage().data_ptr()  # came back from a host copy
    assert isinstance(offload_wrapper(Holder()), OffloadWrapper)


# --- apply_activation_checkpointing --------------------------------------------------------


def both(**kwargs: Any) -> tuple[nn.Module, nn.Module]:
    ours, theirs = make_model(), make_model()
    apply_activation_checkpointing(ours, **kwargs)
    torch_kwargs = dict(kwargs)
    if torch_kwargs.get("checkpoint_wrapper_fn") is None:
        torch_kwargs["checkpoint_wrapper_fn"] = tw.checkpoint_wrapper
    tw.apply_activation_checkpointing(theirs, **torch_kwargs)
    return ours, theirs


def same_shape(ours: nn.Module, theirs: nn.Module) -> None:
    assert [(n, t.replace("CheckpointWrapper", "W")) for n, t in structure(ours)] == [
        (n, t.replace("CheckpointWrapper", "W")) for n, t in structure(theirs)
    ]


def test_apply_with_check_fn_matches_torch() -> None:
    ours, theirs = both(check_fn=lambda m: isinstance(m, MLP))
    same_shape(ours, theirs)
    assert isinstance(ours[1], CheckpointWrapper) and isinstance(ours[3], CheckpointWrapper)
    assert_same(run(ours), run(make_model()))
    assert list(ours.state_dict()) == list(make_model().state_dict())


@pytest.mark.parametrize(
    "policy",
    [
        ModuleWrapPolicy({MLP}),
        functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear)),
        functools.partial(size_based_auto_wrap_policy, min_num_params=100),
    ],
    ids=["ModuleWrapPolicy", "lambda", "size_based"],
)
def test_apply_with_torch_auto_wrap_policies_matches_torch(policy: Any) -> None:
    ours, theirs = both(auto_wrap_policy=policy)
    same_shape(ours, theirs)
    assert any(isinstance(m, CheckpointWrapper) for m in ours.modules())
    assert_same(run(ours), run(make_model()))


def test_apply_with_a_class_set_and_never_the_root() -> None:
    model = make_model()
    apply_activation_checkpointing(model, auto_wrap_policy={MLP, nn.Linear})
    assert type(model) is nn.Sequential
    assert [type(m).__name__ for m in model] == [
        "CheckpointWrapper",
        "CheckpointWrapper",
        "Tanh",
        "CheckpointWrapper",
        "CheckpointWrapper",
    ]
    # Children first: the Linears inside each MLP are wrapped as well (nested).
    assert isinstance(model[1].up, CheckpointWrapper)
    assert_same(run(model), run(make_model()))
    everything = make_model()
    apply_activation_checkpointing(everything)
    assert type(everything) is nn.Sequential


def test_apply_every_nth_block_of_the_gpt() -> None:
    model = GPT(GPTConfig(n_layers=6, seq_len=16))
    apply_activation_checkpointing(model, auto_wrap_policy=every_nth(3, Block))
    assert [type(b).__name__ for b in model.blocks] == ["Block", "Block", "CheckpointWrapper"] * 2
    assert list(model.state_dict()) == list(GPT(GPTConfig(n_layers=6, seq_len=16)).state_dict())
    # The count restarts for every call: every_nth(1) now wraps the rest, not the wrappers.
    apply_activation_checkpointing(model, auto_wrap_policy=every_nth(1, Block))
    assert all(isinstance(b, CheckpointWrapper) for b in model.blocks)
    assert all(type(b._checkpoint_wrapped_module) is Block for b in model.blocks)


def test_apply_twice_wraps_nothing_twice_and_offload_composes() -> None:
    model = make_model()
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, MLP))
    before = structure(model)
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, MLP))
    assert structure(model) == before
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=offload_wrapper, check_fn=lambda m: isinstance(m, nn.Tanh)
    )
    assert isinstance(model[2], OffloadWrapper) and isinstance(model[1], CheckpointWrapper)
    assert all(isinstance(m, ActivationWrapper) for m in (model[1], model[2], model[3]))


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"auto_wrap_policy": {MLP}, "check_fn": lambda m: True}, CheckpointUsageError),
        ({"auto_wrap_policy": 3}, CheckpointTypeError),
        ({"auto_wrap_policy": {int}}, CheckpointTypeError),
        ({"check_fn": "MLP"}, CheckpointTypeError),
        ({"checkpoint_wrapper_fn": lambda m: None}, CheckpointTypeError),
    ],
)
def test_apply_bad_input(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error, match="apply_activation_checkpointing"):
        apply_activation_checkpointing(make_model(), **kwargs)


def test_every_nth_bad_input() -> None:
    with pytest.raises(CheckpointUsageError, match="every_nth"):
        every_nth(0, Block)
    with pytest.raises(CheckpointTypeError, match="every_nth"):
        every_nth(2, "Block")  # type: ignore[arg-type]
