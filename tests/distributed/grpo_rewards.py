"""Reward functions of the GRPO tests, by import path (``grpo_rewards:digit_share``), with
TRL's signature: a user's function as a user writes it."""

from __future__ import annotations

from typing import Any


def digit_share(prompts: list[Any], completions: list[str], **kwargs: Any) -> list[float]:
    """The share of a completion's characters that are digits: a reward with spread
    even for a random model, so every step has non-zero advantages."""
    del prompts, kwargs
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]
