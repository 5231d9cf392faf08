"""checkpoint_module (remat.composable), differential against torch's composable checkpoint."""

from __future__ import annotations

import copy
import gc
import inspect
import pickle
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed._composable import checkpoint as torch_checkpoint_module

import remat
import remat.composable as composable
from helpers import CallCounter, OpCounter, assert_same, grads
from remat.composable import checkpoint_module, remove_checkpoint_module
from remat.errors import CheckpointTypeError, CheckpointUsageError, UnsupportedCheckpointError
from remat.memory import track
from remat.models import Block, GPTConfig
from remat.policies import save_matmuls


class MLP(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return self.down(self.drop(torch.nn.functional.gelu(self.up(x)))) * scale


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), MLP(), nn.Tanh(), MLP(), nn.Linear(8, 4))


def run(model: nn.Module, seed: int = 1) -> tuple[Any, ...]:
    torch.manual_seed(seed)
    x = torch.randn(6, 8, requires_grad=True)
    out = model(x)
    out.pow(2).sum().backward()
    return out, grads(model), x.grad


def apply(model: nn.Sequential, fn: Callable[..., nn.Module], **kwargs: Any) -> nn.Sequential:
    fn(model[1], **kwargs)
    fn(model[3], **kwargs)
    return model


def open_calls() -> tuple[Any, ...]:
    return composable._OPEN.get()


# --- differential ----------------------------------------------------------------------


def test_outputs_grads_and_names_equal_torch_and_plain() -> None:
    plain = make_model()
    ours = apply(make_model(), checkpoint_module)
    theirs = apply(make_model(), torch_checkpoint_module)
    expected = run(plain)
    assert_same(run(ours), expected)  # dropout inside: RNG is replayed
    assert_same(run(theirs), expected)
    for model in (ours, theirs):
        assert list(model.state_dict()) == list(plain.state_dict())
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
        assert [n for n, _ in model.named_modules()] == [n for n, _ in plain.named_modules()]
    assert open_calls() == ()


def test_keyword_arguments_and_nested_modules() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(MLP(), MLP())
    ours = copy.deepcopy(plain)
    checkpoint_module(ours[0], preserve_rng_state=True)
    checkpoint_module(ours[0].up)  # nested: a checkpointed module inside another

    def step(model: nn.Module) -> tuple[Any, ...]:
        torch.manual_seed(2)
        x = torch.randn(3, 8, requires_grad=True)
        out = model[1](model[0](x, scale=2.0), scale=0.5)
        out.sum().backward()
        return out, grads(model), x.grad

    assert_same(step(ours), step(plain))


@pytest.mark.parametrize(
    "factory", [checkpoint_module, torch_checkpoint_module], ids=["remat", "torch"]
)
def test_module_forward_reruns_once_and_hooks_do_not_retrigger(
    factory: Callable[..., nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    module = MLP()
    counter = CallCounter(type(module).forward.__get__(module))
    monkeypatch.setattr(type(module), "forward", lambda self, *a, **k: counter(*a, **k))
    regions: list[Any] = []
    real_region = composable.Region
    monkeypatch.setattr(
        composable, "Region", lambda *a, **k: regions.append(1) or real_region(*a, **k)
    )
    factory(module)
    x = torch.randn(4, 8, requires_grad=True)
    out = module(x)
    assert counter.calls == 1
    out.sum().backward()
    assert counter.calls == 2  # one recomputation
    if factory is checkpoint_module:
        assert len(regions) == 1  # the recomputation opened no region of its own
        assert open_calls() == ()


def test_other_hooks_run_in_the_recomputation_like_torch() -> None:
    counts = {}
    for name, factory in (("remat", checkpoint_module), ("torch", torch_checkpoint_module)):
        module = MLP()
        calls: list[str] = []
        module.register_forward_pre_hook(lambda m, args, calls=calls: calls.append("pre"))
        factory(module)
        module(torch.randn(2, 8, requires_grad=True)).sum().backward()
        counts[name] = calls
    assert counts["remat"] == counts["torch"] == ["pre", "pre"]


def _plain_and_hooked(hook: Callable[..., Any], **options: Any) -> tuple[Any, Any]:
    """Outputs and gradients of an MLP whose ``hook`` was registered before
    ``checkpoint_module``, unchecked and checkpointed (the same seeds)."""
    results = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        module = MLP()
        module.register_forward_pre_hook(hook)
        if checkpointed:
            checkpoint_module(module, **options)
        results.append(run(module))
    return results[0], results[1]


@pytest.mark.parametrize("policy", [None, save_matmuls], ids=["full", "save_matmuls"])
def test_hooks_before_the_region_do_not_transform_the_inputs_twice(policy: Any) -> None:
    # A pre-hook registered before checkpoint_module runs outside the region in
    # the forward; the recomputation must hand the forward what the region got,
    # not the hook's output applied to it again (torch doubles the input here:
    # a silent wrong weight gradient).
    plain, hooked = _plain_and_hooked(lambda module, args: (args[0] * 2,), policy=policy)
    assert_same(plain, hooked)


def test_ops_of_hooks_before_the_region_are_outside_the_selective_replay() -> None:
    # FSDP2's pre-forward hook (prepended, so outside the region) casts the
    # inputs under a profiler range; the recomputation reruns the hook, and a
    # selective policy must not count its ops as the region's. torch's
    # composable checkpoint raises here; remat raised the same before.
    def cast_inputs(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        with torch.profiler.record_function("cast_forward_inputs"):
            return (args[0].to(torch.float32),)

    plain, hooked = _plain_and_hooked(cast_inputs, policy=save_matmuls)
    assert_same(plain, hooked)


@pytest.mark.parametrize("policy", [None, save_matmuls], ids=["full", "save_matmuls"])
def test_random_numbers_drawn_before_the_region_leave_its_dropout_unchanged(policy: Any) -> None:
    # The region's RNG state is captured where the region starts: after the
    # hooks before it. Restoring it before those hooks rerun would give the
    # recomputation another dropout mask (a silent wrong gradient).
    def draw(module: nn.Module, args: tuple[Any, ...]) -> None:
        torch.rand(3)

    plain, hooked = _plain_and_hooked(draw, policy=policy)
    assert_same(plain, hooked)


def test_policy_option_reaches_the_engine() -> None:
    def addmm_in_backward(**kwargs: Any) -> int:
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        checkpoint_module(module, **kwargs)
        out = module(torch.randn(4, 8, requires_grad=True))
        with OpCounter() as counter:
            out.sum().backward()
        return counter.counts["aten.addmm.default"]

    assert addmm_in_backward() == 1  # early stop: the last Linear's output is not needed
    assert addmm_in_backward(early_stop=False) == 2
    assert addmm_in_backward(policy=save_matmuls) == 0


def test_no_grad_call_is_inert() -> None:
    module = checkpoint_module(MLP())
    with torch.no_grad():
        out = module(torch.randn(2, 8))
    assert out.grad_fn is None and open_calls() == ()


def test_end_of_forward_bytes_equal_function_checkpoint() -> None:
    torch.manual_seed(0)
    block = Block(GPTConfig(n_layers=1, seq_len=32))
    hooked = checkpoint_module(copy.deepcopy(block))
    x = torch.randn(2, 32, 128, requires_grad=True)

    def forward_bytes(call: Callable[[torch.Tensor], torch.Tensor]) -> int:
        with track() as tracker:
            out = call(x)
            tracker.mark("forward_end")
            del out
        return tracker.marks["forward_end"]

    assert forward_bytes(hooked) == forward_bytes(lambda t: remat.checkpoint(block, t))
    assert forward_bytes(hooked) < forward_bytes(block) / 4


@pytest.mark.parametrize("early_stop", [True, False])
def test_backward_after_the_recomputation_runs_without_grad_mode(early_stop: bool) -> None:
    # The recomputation turns grad mode on for the module's hooks; it must be off
    # again for the rest of the backward. A leak (it once leaked after an early
    # stop) builds a graph of the gradients, which holds each incoming gradient
    # one node longer: one hidden state more at the peak, seen by the planner.
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 256), nn.GELU(), nn.Linear(256, 64))
    head = nn.Linear(64, 10)
    plain_block = copy.deepcopy(block)
    checkpoint_module(block, early_stop=early_stop)
    seen: list[tuple[bool, bool]] = []

    def watch(grad: torch.Tensor) -> None:
        seen.append((torch.is_grad_enabled(), grad.grad_fn is not None))

    def peak(module: Callable[[torch.Tensor], torch.Tensor]) -> int:
        x = torch.randn(32, 16, requires_grad=True)
        x.register_hook(watch)
        head.zero_grad(set_to_none=True)
        with track() as tracker:
            head(module(x)).sum().backward()
        return tracker.peak_bytes

    function_form = peak(lambda t: remat.checkpoint(plain_block, t, early_stop=early_stop))
    assert peak(block) == function_form
    assert seen == [(False, False), (False, False)]
    for p in block.parameters():
        assert p.grad is not None and p.grad.grad_fn is None


# --- failures leave nothing behind ------------------------------------------------------


class Fails(nn.Module):
    def __init__(self, error: type[BaseException]) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)
        self.error = error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x).exp()
        if self.error is not type(None):
            raise self.error("inside forward")
        return y


def assert_clean_afterwards() -> None:
    assert open_calls() == ()
    # No saved-tensor hooks left: an ordinary graph saves real tensors.
    x = torch.randn(3, requires_grad=True)
    y = x.exp()
    assert isinstance(y.grad_fn._saved_result, torch.Tensor)  # type: ignore[union-attr]
    module = checkpoint_module(MLP())
    plain = copy.deepcopy(module)
    remove_checkpoint_module(plain)
    assert_same(run(module), run(plain))


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_exception_in_forward_leaves_no_state_and_frees_memory(error: type[BaseException]) -> None:
    module = checkpoint_module(Fails(error))
    x = torch.randn(256, 64, requires_grad=True)
    with track() as tracker:
        with pytest.raises(error, match="inside forward"):
            module(x)
        gc.collect()
        tracker.mark("after")
    assert tracker.peak_bytes > 0
    assert tracker.marks["after"] == 0  # the forward's activations are gone
    assert_clean_afterwards()


def test_exception_in_a_later_pre_hook_leaves_no_state() -> None:
    module = checkpoint_module(Fails(type(None)))

    def refuse(m: nn.Module, args: Any) -> None:
        raise RuntimeError("later pre-hook")

    handle = module.register_forward_pre_hook(refuse)
    with pytest.raises(RuntimeError, match="later pre-hook"):
        module(torch.randn(2, 64, requires_grad=True))
    handle.remove()
    assert_clean_afterwards()
    out = module(torch.randn(2, 64, requires_grad=True))
    out.sum().backward()


def test_region_of_a_failed_forward_is_released() -> None:
    module = checkpoint_module(Fails(ValueError))
    x = torch.randn(4, 64, requires_grad=True)
    regions: list[Any] = []
    real_region = composable.Region

    def spy(*args: Any, **kwargs: Any) -> Any:
        regions.append(real_region(*args, **kwargs))
        return regions[-1]

    composable.Region = spy  # type: ignore[misc]
    try:
        with pytest.raises(ValueError):
            module(x)
    finally:
        composable.Region = real_region  # type: ignore[misc]
    (region,) = regions
    frame = weakref.ref(region._frame)
    regions.clear()
    del region
    gc.collect()
    assert frame() is None  # nothing (hooks, open-call stack) keeps the region's frame


# --- usage errors and undo -----------------------------------------------------------------


def test_error_types_match_torch() -> None:
    factories: list[Callable[..., Any]] = [checkpoint_module]
    # torch's composable checkpoint took options only from 2.5 on (2.4: module only).
    if len(inspect.signature(torch_checkpoint_module).parameters) > 1:
        factories.append(torch_checkpoint_module)
    for factory in factories:
        with pytest.raises(NotImplementedError):
            factory(MLP(), use_reentrant=True)
        with pytest.raises(ValueError):
            factory(MLP(), no_such_option=1)
    with pytest.raises(UnsupportedCheckpointError, match="checkpoint_wrapper"):
        checkpoint_module(MLP(), use_reentrant=True)
    with pytest.raises(CheckpointUsageError, match="no_such_option"):
        checkpoint_module(MLP(), no_such_option=1)
    checkpoint_module(MLP(), use_reentrant=False)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"determinism_check": "never"}, CheckpointUsageError),
        ({"context_fn": 3}, CheckpointTypeError),
        ({"policy": save_matmuls, "context_fn": remat.noop_context_fn}, CheckpointUsageError),
    ],
)
def test_bad_option_values(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error, match="checkpoint_module"):
        checkpoint_module(MLP(), **kwargs)


def test_non_module_is_a_type_error() -> None:
    with pytest.raises(CheckpointTypeError, match=r"nn\.Module"):
        checkpoint_module(lambda x: x)  # type: ignore[type-var]


def test_twice_is_an_error_and_remove_undoes_it() -> None:
    module = checkpoint_module(MLP())
    with pytest.raises(CheckpointUsageError, match="already checkpointed"):
        checkpoint_module(module)
    assert remove_checkpoint_module(module) is module
    assert "forward" not in vars(module)
    assert not module._forward_hooks and not module._forward_pre_hooks
    with pytest.raises(CheckpointUsageError, match="not checkpointed"):
        remove_checkpoint_module(module)
    checkpoint_module(module, early_stop=False)  # again, with other options
    assert_same(run(nn.Sequential(module)), run(nn.Sequential(copy.deepcopy(module))))


@pytest.mark.parametrize(
    "clone_fn", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))], ids=["deepcopy", "pickle"]
)
def test_copies_are_independent_checkpointed_modules(
    clone_fn: Callable[[nn.Module], nn.Module],
) -> None:
    module = checkpoint_module(MLP())
    clone = clone_fn(module)
    assert_same(run(clone), run(module))
    state = vars(clone)["_remat_checkpoint_module"]
    assert state.module is clone and state is not vars(module)["_remat_checkpoint_module"]
    assert clone.forward.checkpoint is state  # type: ignore[attr-defined]
    remove_checkpoint_module(clone)  # undoes the copy only
    assert "forward" in vars(module) and module._forward_pre_hooks


def test_forward_keeps_its_signature() -> None:
    module = checkpoint_module(MLP())
    assert inspect.signature(module.forward) == inspect.signature(MLP().forward)
    assert "scale" in inspect.signature(module.forward).parameters


def test_compile_smoke_fullgraph_eager_backend() -> None:
    torch._dynamo.reset()
    model = make_model()
    model.eval()  # no dropout: compiled and eager RNG streams differ
    apply(model, checkpoint_module)
    expected = run(copy.deepcopy(model))
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    out, _, x_grad = run(compiled)
    torch.testing.assert_close(out, expected[0])
    torch.testing.assert_close(x_grad, expected[2])
    assert open_calls() == ()
