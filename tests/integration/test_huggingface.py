"""remat.integrations.huggingface: transformers' gradient checkpointing run by remat.

Tiny models built from local configs (no download): 2 layers, hidden size 32,
dropout 0. Oracles: the same model without checkpointing and with
transformers' own (torch.utils.checkpoint) checkpointing, compared exactly;
an op counter and a counting policy show that remat's function really runs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

import remat.policies
from helpers import OpCounter, tiny_llama_config
from remat.errors import CheckpointTypeError, CheckpointUsageError, UnsupportedCheckpointError
from remat.integrations.huggingface import (
    RematCheckpointFunction,
    disable_gradient_checkpointing,
    enable_gradient_checkpointing,
    is_remat_checkpointing,
)
from remat.memory import track
from remat.policies import CheckpointPolicy

transformers = pytest.importorskip("transformers")

VOCAB = 64


def test_missing_transformers_gives_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # the import now fails
    with pytest.raises(UnsupportedCheckpointError, match=r"pip install remat\[hf\]"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2))


def llama() -> Any:
    config = tiny_llama_config(vocab_size=VOCAB, num_hidden_layers=2, attention_dropout=0.0)
    return transformers.LlamaForCausalLM(config)


def gpt2() -> Any:
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


MODELS = {"llama": llama, "gpt2": gpt2}


def transformers_enable(model: Any) -> None:
    """transformers' own enable, under its 5.x name or the 4.x one (4.57 has only the old)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()


def transformers_checkpointing(model: Any) -> bool:
    """transformers' own flag, under its 5.x or 4.x name."""
    flag = getattr(model, "is_activation_checkpointing", None)
    return bool(model.is_gradient_checkpointing if flag is None else flag)


def build(make: Callable[[], Any]) -> Any:
    torch.manual_seed(0)
    return make().train()


def batch(seq: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))


def step(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients of one training step."""
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def assert_same_step(
    actual: tuple[Any, Any], expected: tuple[Any, Any], exact: bool = True
) -> None:
    (loss, grads), (expected_loss, expected_grads) = actual, expected
    assert torch.equal(loss, expected_loss)
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        assert grads[name] is not None, name
        if exact:
            assert torch.equal(grads[name], grad), f"{name}: {(grads[name] - grad).abs().max()}"
        else:
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize(
    "policy", [None, remat.policies.save_matmuls], ids=["full", "save_matmuls"]
)
def test_same_loss_and_gradients(model_name: str, policy: Any) -> None:
    ids = batch()
    plain = step(build(MODELS[model_name]), ids)

    hf = build(MODELS[model_name])
    transformers_enable(hf)  # transformers' own: torch.utils.checkpoint
    assert transformers_checkpointing(hf) and not is_remat_checkpointing(hf)
    hf_step = step(hf, ids)

    model = build(MODELS[model_name])
    enable_gradient_checkpointing(model, policy=policy)
    assert is_remat_checkpointing(model)
    remat_step = step(model, ids)

    assert_same_step(hf_step, plain)
    assert_same_step(remat_step, plain)


def test_reentrant_variant() -> None:
    ids = batch()
    plain = step(build(llama), ids)
    model = build(llama)
    enable_gradient_checkpointing(model, use_reentrant=True)
    # The recompute sums each layer's input gradient on its own: equal to rounding.
    assert_same_step(step(model, ids), plain, exact=False)


def _phase_counts(model: Any, ids: torch.Tensor) -> tuple[int, int]:
    """(forward, backward) matmul counts of one training step."""
    model.zero_grad()
    with OpCounter() as counter:
        loss = model(input_ids=ids, labels=ids).loss
        forward = counter.take()
        loss.backward()
        backward = counter.take()
    return forward["aten.mm.default"], backward["aten.mm.default"]


def test_remat_function_really_runs() -> None:
    ids = batch()
    plain_forward, plain_backward = _phase_counts(build(llama), ids)
    assert plain_forward > 0

    # Full recomputation: every layer's forward matmuls run again in backward.
    model = build(llama)
    enable_gradient_checkpointing(model)
    _, full_backward = _phase_counts(model, ids)
    assert full_backward > plain_backward

    # save_matmuls: only remat honours a policy; no matmul is recomputed.
    model = build(llama)
    enable_gradient_checkpointing(model, policy=remat.policies.save_matmuls)
    assert _phase_counts(model, ids) == (plain_forward, plain_backward)

    # A policy that counts what remat shows it, then recomputes everything.
    seen: list[str] = []

    def counting_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        seen.append(str(op))
        return CheckpointPolicy.PREFER_RECOMPUTE

    model = build(llama)
    enable_gradient_checkpointing(model, policy=counting_policy)
    assert _phase_counts(model, ids)[1] == full_backward
    assert seen.count("aten.mm.default") > 0


def test_memory_at_end_of_forward_drops() -> None:
    ids = batch(seq=64)

    def forward_end_bytes(policy: Any = None, checkpointed: bool = True) -> int:
        model = build(llama)
        if checkpointed:
            enable_gradient_checkpointing(model, policy=policy)
        with track() as tracker:
            loss = model(input_ids=ids, labels=ids).loss
            tracker.mark("forward_end")
            loss.backward()
        return tracker.marks["forward_end"]

    plain = forward_end_bytes(checkpointed=False)
    saving_matmuls = forward_end_bytes(remat.policies.save_matmuls)
    full = forward_end_bytes()
    assert full < saving_matmuls < plain
    assert full < 0.6 * plain, (full, plain)


def test_disable_and_transformers_default_again() -> None:
    model = build(gpt2)
    enable_gradient_checkpointing(model)
    disable_gradient_checkpointing(model)
    assert not is_remat_checkpointing(model) and not transformers_checkpointing(model)
    transformers_enable(model)
    assert transformers_checkpointing(model) and not is_remat_checkpointing(model)


def test_every_n_layers() -> None:
    model = build(llama)
    if not hasattr(model, "activation_checkpointing_enable"):  # transformers 4.x
        with pytest.raises(UnsupportedCheckpointError, match="every_n_layers is not supported"):
            enable_gradient_checkpointing(model, every_n_layers=2)
        assert not transformers_checkpointing(model) and not is_remat_checkpointing(model)
        return
    enable_gradient_checkpointing(model, every_n_layers=2)
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False]
    assert is_remat_checkpointing(model)


def test_checkpoint_options_reach_remat() -> None:
    model = build(llama)
    enable_gradient_checkpointing(model, early_stop=False, determinism_check="none")
    function = model.model.layers[0]._gradient_checkpointing_func
    assert isinstance(function, RematCheckpointFunction)
    assert dict(function.options) == {
        "use_reentrant": False,
        "early_stop": False,
        "determinism_check": "none",
    }


@pytest.mark.parametrize(
    ("model", "kwargs", "error", "match"),
    [
        (torch.nn.Linear(2, 2), {}, CheckpointTypeError, "PreTrainedModel"),
        (None, {"no_such_option": 1}, CheckpointUsageError, "no_such_option"),
        (
            None,
            {"use_reentrant": True, "policy": remat.policies.save_matmuls},
            CheckpointUsageError,
            "use_reentrant=False",
        ),
        (None, {"every_n_layers": 0}, CheckpointUsageError, "every_n_layers"),
        (None, {"policy": "save_matmuls"}, CheckpointTypeError, "policy"),
        (None, {"policy": [torch.ops.aten.mm]}, CheckpointUsageError, "OpOverloadPacket"),
        (None, {"use_reentrant": "yes"}, CheckpointTypeError, "use_reentrant"),
    ],
)
def test_bad_input(model: Any, kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    target = build(llama) if model is None else model
    with pytest.raises(error, match=match):
        enable_gradient_checkpointing(target, **kwargs)
    if model is None:
        assert not transformers_checkpointing(target)  # nothing half-enabled


def test_model_without_checkpointing_support() -> None:
    model = build(gpt2)
    model.supports_gradient_checkpointing = False
    with pytest.raises(UnsupportedCheckpointError, match="apply_activation_checkpointing"):
        enable_gradient_checkpointing(model)


# -- transformers' enable called again (the Trainer does it) ---------------------


def _count_remat_regions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts calls of remat's installed function (one per checkpointed layer call)."""
    calls: list[int] = []
    original = RematCheckpointFunction.__call__

    def counting(self: Any, function: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(self, function, *args, **kwargs)

    monkeypatch.setattr(RematCheckpointFunction, "__call__", counting)
    return calls


def test_enable_again_keeps_remat(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build(llama)
    enable_gradient_checkpointing(model, early_stop=False)
    model.gradient_checkpointing_enable()  # what the Trainer does
    transformers_enable(model)
    assert is_remat_checkpointing(model)
    function = model.model.layers[0]._gradient_checkpointing_func
    assert dict(function.options) == {"use_reentrant": False, "early_stop": False}
    calls = _count_remat_regions(monkeypatch)
    step(model, batch())
    assert len(calls) == len(model.model.layers)


def test_enable_again_passes_remat_options_through_kwargs() -> None:
    ids = batch()
    plain_forward, plain_backward = _phase_counts(build(llama), ids)
    model = build(llama)
    enable_gradient_checkpointing(model)
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"policy": remat.policies.save_matmuls}
    )
    function = model.model.layers[0]._gradient_checkpointing_func
    assert function.options["policy"] is remat.policies.save_matmuls
    # The policy is honoured: no matmul is recomputed.
    assert _phase_counts(model, ids) == (plain_forward, plain_backward)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"gradient_checkpointing_kwargs": {"no_such_option": 1}}, CheckpointUsageError,
         "no_such_option"),
        ({"gradient_checkpointing_kwargs": {"use_reentrant": "yes"}}, CheckpointTypeError,
         "use_reentrant"),
        ({"no_such_argument": 1}, CheckpointUsageError, "no_such_argument"),
    ],
)
def test_enable_again_rejects_bad_options(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    model = build(llama)
    enable_gradient_checkpointing(model)
    with pytest.raises(error, match=match):
        model.gradient_checkpointing_enable(**kwargs)
    assert is_remat_checkpointing(model)  # the earlier remat setup stays


def test_disable_then_enable_is_transformers_again() -> None:
    model = build(llama)
    enable_gradient_checkpointing(model)
    model.gradient_checkpointing_disable()
    assert not is_remat_checkpointing(model) and not transformers_checkpointing(model)
    model.gradient_checkpointing_enable()
    assert transformers_checkpointing(model) and not is_remat_checkpointing(model)


def test_a_deep_copy_keeps_remat_on_itself() -> None:
    # (Pickling is not tested: transformers' own input-grad hook is a local
    # function, so a checkpointing model does not pickle even without remat.)
    import copy

    model = build(llama)
    enable_gradient_checkpointing(model, early_stop=False)
    twin = copy.deepcopy(model)
    transformers_enable(twin)
    assert is_remat_checkpointing(twin)
    # The copy's enable and disable act on the copy, not on the original.
    twin.gradient_checkpointing_disable()
    assert not is_remat_checkpointing(twin) and is_remat_checkpointing(model)


def test_the_function_pickles_and_copies() -> None:
    import copy
    import pickle

    function = RematCheckpointFunction(
        offload_inputs=True, policy=remat.policies.save_matmuls, early_stop=False
    )
    for twin in (copy.deepcopy(function), pickle.loads(pickle.dumps(function))):
        assert isinstance(twin, RematCheckpointFunction) and twin.offload_inputs
        assert dict(twin.options) == dict(function.options)


def _train(model: Any, tmp_path: Any, gradient_checkpointing: bool, **kwargs: Any) -> Any:
    ids = torch.randint(0, VOCAB, (8, 16), generator=torch.Generator().manual_seed(2))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        gradient_checkpointing=gradient_checkpointing,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
        **kwargs,
    )
    transformers.Trainer(model=model, args=args, train_dataset=data).train()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_trainer_keeps_remat_with_equal_results(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("accelerate")  # the Trainer needs it
    plain = _train(build(llama), tmp_path, gradient_checkpointing=False)
    model = build(llama)
    enable_gradient_checkpointing(model)
    calls = _count_remat_regions(monkeypatch)
    trained = _train(
        model, tmp_path, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"policy": remat.policies.save_matmuls},
    )
    assert is_remat_checkpointing(model)
    assert model.model.layers[0]._gradient_checkpointing_func.options["policy"] is (
        remat.policies.save_matmuls
    )
    # Three steps, each layer checkpointed once per step, all by remat.
    assert len(calls) == 3 * len(model.model.layers)
    for name, weight in plain.items():
        assert torch.equal(trained[name], weight), name


def test_offload_layer_inputs() -> None:
    ids = batch()
    plain = step(build(llama), ids)
    model = build(llama)
    enable_gradient_checkpointing(model)
    enable_again = getattr(model, "activation_checkpointing_enable", None)
    if enable_again is None:  # transformers 4.x has no offload argument: remat's own
        enable_gradient_checkpointing(model, offload=True)
    else:
        enable_again(offload=True)  # transformers' argument, served by remat
    function = model.model.layers[0]._gradient_checkpointing_func
    assert isinstance(function, RematCheckpointFunction) and function.offload_inputs
    report = remat.memory.saved_tensors(model, input_ids=ids, labels=ids)
    assert report.bytes_by_fate()["offloaded"] > 0, report.bytes_by_fate()
    assert_same_step(step(model, ids), plain)
