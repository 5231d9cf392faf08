"""A WGAN-GP critic step through checkpointed blocks: the plain run's gradients.

The gradient penalty differentiates the critic's input gradient (a double
backward through every region), and the step also backpropagates the real
and fake scores, so each region is recomputed for several backward calls.
The critic is a small residual MLP with LayerNorm (WGAN-GP critics avoid
batch norm) whose hidden activations carry names. Selective regions replay
their cached outputs for every one of those backwards (docs/design/lifetimes.md);
reentrant regions recompute under the first backward the graph that the
second one goes through (docs/design/reentrant.md).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat import policies
from remat.memory import track

DIM, HIDDEN, BATCH = 16, 64, 32


class CriticBlock(nn.Module):
    """Pre-norm residual block: LayerNorm, two linears, named hidden activations."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        u = remat.name(self.up(self.norm(h)), "up")
        u = remat.name(F.leaky_relu(u, 0.2), "act")
        return h + self.down(u)


class Critic(nn.Module):
    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, HIDDEN)
        self.blocks = nn.ModuleList(CriticBlock() for _ in range(blocks))
        self.score = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor, checkpoint: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h) if checkpoint is None else checkpoint(block, h)
        return self.score(h)


CHECKPOINTS: dict[str, Callable[..., torch.Tensor] | None] = {
    "plain": None,
    "full": remat.checkpoint,
    "save_matmuls": functools.partial(remat.checkpoint, policy=policies.save_matmuls),
    "save_only_names": functools.partial(remat.checkpoint, policy=policies.save_only_names("up")),
    "save_all_but_names": functools.partial(remat.checkpoint, policy=policies.save_all_but_names("act")),
    # As older Hugging Face code wraps its layers (docs/design/reentrant.md, "Double backward").
    "reentrant": functools.partial(remat.checkpoint, use_reentrant=True),
}


def critic_step(how: str, *, tracker: Any = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One WGAN-GP critic step (penalty weight 10); the loss and the critic's gradients."""
    torch.manual_seed(0)
    critic, generator = Critic().double(), nn.Sequential(nn.Linear(8, DIM), nn.Tanh()).double()
    real = torch.randn(BATCH, DIM, dtype=torch.float64)
    fake = generator(torch.randn(BATCH, 8, dtype=torch.float64)).detach()
    alpha = torch.rand(BATCH, 1, dtype=torch.float64)
    mixed = (alpha * real + (1 - alpha) * fake).requires_grad_()
    checkpoint = CHECKPOINTS[how]
    with contextlib.nullcontext() if tracker is None else tracker:
        scores = critic(mixed, checkpoint)
        (grad,) = torch.autograd.grad(scores.sum(), mixed, create_graph=True)
        penalty = ((grad.norm(2, dim=1) - 1) ** 2).mean()
        loss = critic(fake, checkpoint).mean() - critic(real, checkpoint).mean() + 10 * penalty
        loss.backward()
    return loss.detach(), {name: p.grad for name, p in critic.named_parameters()}


@pytest.mark.parametrize("how", [h for h in CHECKPOINTS if h != "plain"])
def test_wgan_gp_step_matches_unchecked_bitwise(how: str) -> None:
    want_loss, want = critic_step("plain")
    got_loss, got = critic_step(how)
    assert torch.equal(got_loss, want_loss)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_r1_penalty_on_real_data_through_a_selective_or_reentrant_region_matches_unchecked() -> None:
    # R1 (StyleGAN's regularizer): the squared input gradient on real data,
    # differentiated again, with the scores retained for a second loss.
    def step(checkpoint: Callable[..., torch.Tensor] | None) -> list[torch.Tensor]:
        torch.manual_seed(1)
        critic = Critic(blocks=2).double()
        real = torch.randn(BATCH, DIM, dtype=torch.float64, requires_grad=True)
        scores = critic(real, checkpoint)
        (grad,) = torch.autograd.grad(scores.sum(), real, create_graph=True)
        r1 = grad.pow(2).sum(1).mean()
        params = list(critic.parameters())
        first = torch.autograd.grad(r1, params, retain_graph=True, allow_unused=True, materialize_grads=True)
        second = torch.autograd.grad(F.softplus(-scores).mean(), params)
        return [*first, *second]

    want = step(None)
    for how in ("save_matmuls", "save_only_names", "reentrant"):
        for got, expected in zip(step(CHECKPOINTS[how]), want, strict=True):
            assert torch.equal(got, expected), how


def test_gradient_penalty_memory_sits_between_full_checkpointing_and_none() -> None:
    # The numbers behind docs/design/lifetimes.md ("What a selective region
    # costs"): the cached matmuls are what a policy keeps beyond full
    # checkpointing, kept for the graph's lifetime.
    peaks = {}
    for how in CHECKPOINTS:
        tracker = track()
        critic_step(how, tracker=tracker)
        peaks[how] = tracker.peak_bytes
    assert peaks["full"] < peaks["save_only_names"] <= peaks["save_matmuls"] < peaks["plain"]
