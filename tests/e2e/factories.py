"""Model factories used by the e2e tests through ``model.factory``."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn

from support import MLPNet


def token_mlp() -> nn.Module:
    """A non-transformer LM over the byte vocabulary (residual-MLP blocks)."""
    return MLPNet(vocab=256)


class Exploding(MLPNet):
    """Raises on rank 1 at its third forward: a rank failing mid-training."""

    calls = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        Exploding.calls += 1
        if os.environ.get("RANK") == "1" and Exploding.calls == 3:
            raise RuntimeError("injected failure on rank 1")
        return super().forward(tokens)


def exploding() -> nn.Module:
    return Exploding(vocab=256)


def gpt2_nan_on_rank1() -> tuple[nn.Module, Any]:
    """A transformers GPT-2 (its forward returns a ModelOutput) whose loss turns NaN on
    rank 1 only, at the third training step."""
    from tiny_hf import tiny_config
    from transformers import GPT2LMHeadModel

    from fsdpkit.loss.contract import next_token_loss

    calls = 0

    def loss_fn(module: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        loss = next_token_loss(module, tokens)
        if os.environ.get("RANK") == "1" and calls == 3:
            return loss * float("nan")
        return loss

    return GPT2LMHeadModel(tiny_config("gpt2", vocab_size=256, dim=32)), loss_fn


class Sluggish(MLPNet):
    """Sleeps ``FSDPKIT_TEST_FORWARD_DELAY`` seconds per forward (default 0): steps
    long enough for a test to signal a run in the middle of one."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        time.sleep(float(os.environ.get("FSDPKIT_TEST_FORWARD_DELAY", "0")))
        return super().forward(tokens)


def sluggish() -> nn.Module:
    return Sluggish(vocab=256)


class Hanging(MLPNet):
    """Rank ``FSDPKIT_TEST_HANG_RANK`` falls asleep in its ``FSDPKIT_TEST_HANG_CALL``-th
    forward (default 3: inside step 3) for ``FSDPKIT_TEST_HANG_S`` seconds (default
    600): a rank that stops inside a step while its peers wait in a collective. It
    writes the time it fell asleep to ``FSDPKIT_TEST_HANG_MARK`` when that is set."""

    calls = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        Hanging.calls += 1
        env = os.environ
        if env.get("RANK") == env.get("FSDPKIT_TEST_HANG_RANK") and Hanging.calls == int(
            env.get("FSDPKIT_TEST_HANG_CALL", "3")
        ):
            asleep_inside_a_step(float(env.get("FSDPKIT_TEST_HANG_S", "600")))
        return super().forward(tokens)


def asleep_inside_a_step(seconds: float) -> None:
    """The frame a hang report must show for the sleeping rank."""
    mark = os.environ.get("FSDPKIT_TEST_HANG_MARK")
    if mark:
        with open(mark, "w") as f:
            f.write(repr(time.time()))
    time.sleep(seconds)


def hanging() -> nn.Module:
    return Hanging(vocab=256)


class ScaledEmbedding(MLPNet):
    """Scales its embedding's output in its own forward, between the embedding and the
    first block: pipeline stages cannot hand its hidden states over ([Note: stage
    boundaries])."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) * 8.0
        for block in self.blocks:
            h = block(h)
        return self.head(h)  # type: ignore[no-any-return]


def scaled_embedding() -> nn.Module:
    return ScaledEmbedding(vocab=256)
