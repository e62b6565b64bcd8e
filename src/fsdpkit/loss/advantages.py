"""Group-relative advantages: each completion's reward against its prompt's other
completions (GRPO, Shao et al. 2024), scaled as TRL 1.16's GRPOTrainer scales them.

[Note: group-relative advantages]
The rewards of one step arrive as one flat vector over the whole (global) batch, in
TRL's order: prompt ``p``'s ``G`` completions are entries ``p*G .. p*G + G - 1``. With
``r`` a group's rewards, ``mean`` their mean and ``std`` an unbiased (Bessel) standard
deviation, the advantage of a completion is

- ``scale = "group"``: ``(r - mean) / (std_group + 1e-4)`` (the GRPO paper);
- ``scale = "batch"``: ``(r - mean) / (std_batch + 1e-4)``, the standard deviation over
  every reward of the batch (PPO-Lite's recommendation; the baseline stays per group);
- ``scale = "none"``: ``r - mean`` (Dr. GRPO: dividing by the group's spread biases the
  update towards questions that are too easy or too hard).

A group whose rewards are all equal has advantages 0 whatever the scale: it teaches
nothing, and the share of such groups is the first thing an RL practitioner watches
(DAPO's dynamic sampling drops them). The epsilon keeps a zero spread finite; a single
completion per group (or a batch of one) has spread 0 by definition, as in TRL.

The rewards must be the global batch's, gathered from every rank before this is called:
a group's completions may be drawn on different ranks and the batch scale spans them
all. TRL gives a completion for which every reward function returned None a NaN reward,
leaves it out of its group's statistics and gives it advantage 0; fsdpkit's reward layer
refuses such a row by name instead, so a non-finite reward reaching this function is a
bug upstream and raises here rather than being averaged in or zeroed silently.

The zero-spread share is counted per group under every scale; TRL's
``frac_reward_zero_std`` under ``scale = "batch"`` is instead whether the whole batch's
spread is zero (0 or 1), which says nothing about how many groups carry no signal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALES = ("group", "batch", "none")
STD_EPSILON = 1e-4
"""Added to the standard deviation before dividing (TRL's constant)."""


@dataclass(frozen=True)
class GroupAdvantages:
    """Advantages of one global batch and what its metrics need."""

    advantages: torch.Tensor
    """(n_prompts * G,) one per completion, in the rewards' order."""
    group_std: torch.Tensor
    """(n_prompts,) each group's unbiased reward standard deviation (0 when G = 1)."""
    zero_spread_share: torch.Tensor
    """Scalar: the share of groups whose rewards are all equal (std 0, as TRL tests it)."""


def _unbiased_std(values: torch.Tensor, *, dim: int | None) -> torch.Tensor:
    """Bessel-corrected standard deviation; 0 where a single value is reduced."""
    count = values.numel() if dim is None else values.shape[dim]
    if count < 2:
        shape = () if dim is None else values.shape[:dim] + values.shape[dim + 1 :]
        return values.new_zeros(shape)
    return values.std() if dim is None else values.std(dim=dim)


def group_advantages(
    rewards: torch.Tensor, *, group_size: int, scale: str = "group"
) -> GroupAdvantages:
    """Advantages of ``rewards`` (global batch, a prompt's ``group_size`` completions
    contiguous) scaled by ``scale`` ([Note: group-relative advantages])."""
    if scale not in SCALES:
        raise ValueError(f"scale = {scale!r} is not one of {', '.join(SCALES)}")
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)} are not whole groups of group_size = "
            f"{group_size}: pass one reward per completion, a prompt's completions contiguous"
        )
    bad = (~torch.isfinite(rewards)).nonzero()
    if bad.numel():
        raise ValueError(
            f"reward {rewards[bad[0, 0]].item()} at completion {bad[0, 0].item()} (prompt "
            f"{bad[0, 0].item() // group_size}) is not finite: the reward functions must refuse "
            "an unscorable completion by name before advantages are computed"
        )
    groups = rewards.reshape(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    group_std = _unbiased_std(groups, dim=1)
    centred = groups - mean
    if scale == "group":
        centred = centred / (group_std.unsqueeze(1) + STD_EPSILON)
    elif scale == "batch":
        centred = centred / (_unbiased_std(rewards, dim=None) + STD_EPSILON)
    zero = torch.isclose(group_std, torch.zeros_like(group_std))
    return GroupAdvantages(
        advantages=centred.reshape(-1),
        group_std=group_std,
        zero_spread_share=zero.to(rewards.dtype).mean(),
    )
