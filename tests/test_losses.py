"""remat.losses: the head and loss in slices equal the unchunked loss, with less memory."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from helpers import tiny_llama_config
from remat import chunked_head_loss, chunked_loss
from remat.errors import CheckpointTypeError, CheckpointUsageError
from remat.memory import track
from remat.models import GPT, GPTConfig, lm_loss, make_batch


def head_and_batch(vocab: int = 97, d: int = 16, batch: int = 3, seq: int = 10):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    head = torch.nn.Linear(d, vocab)
    hidden = torch.randn(batch, seq, d, requires_grad=True)
    targets = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    return head, hidden, targets


def grads_of(loss: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 10])
def test_equals_the_unchunked_cross_entropy(chunks: int) -> None:
    head, hidden, targets = head_and_batch()
    targets[0, :4] = -100  # ignored positions: the mean is over the others
    expected = F.cross_entropy(head(hidden).flatten(0, 1), targets.flatten())
    got = chunked_loss(head, hidden, targets, chunks=chunks)
    torch.testing.assert_close(got, expected)
    for a, b in zip(
        grads_of(got, hidden, head.weight, head.bias),
        grads_of(expected, hidden, head.weight, head.bias),
        strict=True,
    ):
        torch.testing.assert_close(a, b)


def test_one_chunk_is_bitwise_the_plain_loss() -> None:
    head, hidden, targets = head_and_batch()
    expected = F.cross_entropy(head(hidden).flatten(0, 1), targets.flatten())
    got = chunked_loss(head, hidden, targets, chunks=1)
    assert torch.equal(got, expected)
    for a, b in zip(grads_of(got, hidden, head.weight), grads_of(expected, hidden, head.weight), strict=True):
        assert torch.equal(a, b)


def test_a_custom_summed_loss_and_another_dim() -> None:
    head, hidden, targets = head_and_batch(seq=6)

    def squared(outputs: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return ((outputs.argmax(-1) == t).float() + outputs.square().mean(-1)).sum()

    expected = squared(head(hidden), targets)
    got = chunked_loss(head, hidden, targets, chunks=3, loss=squared, dim=0)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(grads_of(got, hidden)[0], grads_of(expected, hidden)[0])


def test_bf16_autocast_matches_the_unchunked_loss() -> None:
    head, hidden, targets = head_and_batch(vocab=256, d=32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.cross_entropy(head(hidden).flatten(0, 1), targets.flatten())
        got = chunked_loss(head, hidden, targets, chunks=5)
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
    a, = grads_of(got, head.weight)
    b, = grads_of(expected, head.weight)
    torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def test_the_logits_never_exist_at_once() -> None:
    # vocab >> d: the logits, the log-softmax and their gradients dominate.
    head, hidden, targets = head_and_batch(vocab=4096, d=32, batch=4, seq=64)
    logits_bytes = 4 * 64 * 4096 * 4

    def peak(chunks: int) -> int:
        with track() as tracker:
            chunked_loss(head, hidden, targets, chunks=chunks).backward()
        return tracker.peak_bytes

    whole, sliced = peak(1), peak(16)
    assert whole >= 2 * logits_bytes
    assert sliced < whole / 4
    assert sliced < logits_bytes / 2


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"chunks": 0}, CheckpointUsageError, "chunks must be an int >= 1"),
        ({"chunks": True}, CheckpointUsageError, "chunks must be an int >= 1"),
        ({"chunks": 11}, CheckpointUsageError, "at most 10"),
        ({"chunks": 2, "dim": -1}, CheckpointUsageError, "not its last"),
        ({"chunks": 2, "dim": 2}, CheckpointUsageError, "not its last"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception], words: str) -> None:
    head, hidden, targets = head_and_batch()
    with pytest.raises(error, match=words):
        chunked_loss(head, hidden, targets, **kwargs)


def test_mismatched_targets_and_non_tensors() -> None:
    head, hidden, targets = head_and_batch()
    with pytest.raises(CheckpointUsageError, match="same size along dim 1"):
        chunked_loss(head, hidden, targets[:, :5], chunks=2)
    with pytest.raises(CheckpointTypeError, match="must be tensors"):
        chunked_loss(head, hidden, [1, 2], chunks=2)  # type: ignore[arg-type]
    with pytest.raises(CheckpointTypeError, match="head must be callable"):
        chunked_loss(3, hidden, targets, chunks=2)  # type: ignore[arg-type]


def gpt_and_batch():  # type: ignore[no-untyped-def]
    config = GPTConfig(n_layers=2, d_model=32, n_heads=4, d_ff=64, seq_len=16, vocab_size=128)
    torch.manual_seed(0)
    idx, targets = make_batch(config, 2, torch.Generator().manual_seed(0))
    return GPT(config), idx, targets


def assert_same_loss_and_grads(
    got: torch.Tensor, expected: torch.Tensor, model: torch.nn.Module, reference: torch.nn.Module
) -> None:
    """The chunked loss and the unchunked one agree, and so do every parameter's gradients."""
    torch.testing.assert_close(got, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_whole_model_equals_the_unchunked_loss() -> None:
    model, idx, targets = gpt_and_batch()
    reference = copy.deepcopy(model)
    expected = lm_loss(reference(idx), targets)
    expected.backward()
    got = chunked_head_loss(model, (idx,), head="head", targets=targets, chunks=4)
    got.backward()
    assert_same_loss_and_grads(got, expected, model, reference)
    assert "forward" not in vars(model.head)  # the head is restored


def test_a_hugging_face_llama() -> None:
    transformers = pytest.importorskip("transformers")
    config = tiny_llama_config(vocab_size=256, num_hidden_layers=2, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = reference(input_ids=ids).logits
    expected = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
    expected.backward()
    got = chunked_head_loss(model, (ids,), head="lm_head", targets=ids, chunks=4)
    got.backward()
    assert_same_loss_and_grads(got, expected, model, reference)


def test_misuse_of_the_head() -> None:
    model, idx, targets = gpt_and_batch()
    with pytest.raises(CheckpointUsageError, match="no submodule 'lm_head'"):
        chunked_head_loss(model, (idx,), head="lm_head", targets=targets, chunks=2)
    with pytest.raises(CheckpointUsageError, match="ran 0 times"):
        chunked_head_loss(model, (idx,), head=torch.nn.Linear(2, 2), targets=targets, chunks=2)
    with pytest.raises(CheckpointTypeError, match="submodule or its name"):
        chunked_head_loss(model, (idx,), head=3, targets=targets, chunks=2)  # type: ignore[arg-type]

    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.out = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.out(x))

    with pytest.raises(CheckpointUsageError, match="ran 2 times"):
        chunked_head_loss(Twice(), (torch.randn(2, 3, 4),), head="out",
                          targets=torch.zeros(2, 3, dtype=torch.long), chunks=1)
    model.head.forward = model.head.forward  # patched on the instance, e.g. by a plan
    with pytest.raises(CheckpointUsageError, match="already has its forward replaced"):
        chunked_head_loss(model, (idx,), head="head", targets=targets, chunks=2)


def test_a_model_that_computes_on_the_logits_is_refused() -> None:
    # Logit soft-capping (Gemma 2 style) after the head: the head's loss alone
    # would be another loss, so it must be an error, not a silent difference.
    class SoftCapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(8, 8)
            self.lm_head = torch.nn.Linear(8, 32)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            logits = self.lm_head(self.body(x))
            return {"logits": 30.0 * torch.tanh(logits / 30.0)}

    class Views(SoftCapped):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"logits": self.lm_head(self.body(x))[:, :].reshape(x.shape[0], x.shape[1], 32)}

    x = torch.randn(2, 5, 8)
    targets = torch.randint(0, 32, (2, 5))
    with pytest.raises(CheckpointUsageError, match="soft-caps"):
        chunked_head_loss(SoftCapped(), (x,), head="lm_head", targets=targets, chunks=2)
    chunked_head_loss(Views(), (x,), head="lm_head", targets=targets, chunks=2).backward()  # views pass
