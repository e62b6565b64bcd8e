"""Group-relative advantages equal TRL 1.16's for every reward scale.

TRL's advantage lines live inside ``GRPOTrainer._generate_and_score_completions``,
reachable only through a whole trainer (generation, reward calls, gathers): the test
cuts those lines out of TRL's installed source and runs them as they are, on a
stand-in ``self`` and our rewards. Tolerances are absolute (1e-6).
"""

from __future__ import annotations

import inspect
import textwrap
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import nanstd

from fsdpkit.loss.advantages import group_advantages

ATOL = 1e-6


def _trl_advantages(rewards: torch.Tensor, *, group_size: int, scale: str) -> dict[str, Any]:
    """TRL's own advantage lines, cut out of its installed source and run as they are."""
    source = textwrap.dedent(inspect.getsource(GRPOTrainer._generate_and_score_completions))
    first = source.index('if self.multi_objective_aggregation == "sum_then_normalize":')
    last = source.index("advantages = torch.nan_to_num(advantages, nan=0.0)")
    start = source.rindex("\n", 0, first) + 1
    block = textwrap.dedent(source[start : source.index("\n", last)])
    namespace: dict[str, Any] = {
        "torch": torch,
        "nanstd": nanstd,
        "device": rewards.device,
        "num_generations": group_size,
        "rewards_per_func": rewards.unsqueeze(1),
        "unscorable_mask": torch.zeros(rewards.shape[0], dtype=torch.bool),
        "self": SimpleNamespace(
            multi_objective_aggregation="sum_then_normalize",
            scale_rewards=scale,
            reward_weights=torch.ones(1),
            reward_funcs=[None],
        ),
    }
    exec(compile(block, "trl-grpo-advantages", "exec"), namespace)
    return namespace


def _rewards(groups: int, size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    rewards = torch.randint(0, 2, (groups, size), generator=g).float()  # pass / fail
    rewards[1] = 1.0  # a group every completion solved: zero spread
    rewards[2] += torch.rand(size, generator=g)  # continuous rewards
    if groups > 3:
        rewards[3] = 0.0
    return rewards.reshape(-1)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("group_size", [4, 1])
def test_advantages_equal_trls(scale: str, group_size: int) -> None:
    rewards = _rewards(5, group_size)
    trl = _trl_advantages(rewards, group_size=group_size, scale=scale)
    ours = group_advantages(rewards, group_size=group_size, scale=scale)
    assert (ours.advantages - trl["advantages"]).abs().max().item() <= ATOL
    group_std = trl["std_rewards"][::group_size]
    if scale != "batch":  # TRL's std under "batch" is the batch's, ours per group
        assert (ours.group_std - group_std).abs().max().item() <= ATOL
        share = trl["is_std_zero"].float().mean()
        assert ours.zero_spread_share.item() == pytest.approx(share.item())
    if group_size > 1:
        assert ours.zero_spread_share.item() == pytest.approx(2 / 5)


def test_advantages_refuse_what_is_not_whole_finite_groups() -> None:
    with pytest.raises(ValueError, match="group_size = 4"):
        group_advantages(torch.zeros(6), group_size=4)
    with pytest.raises(ValueError, match="completion 5 \\(prompt 1\\)"):
        group_advantages(torch.tensor([0, 1, 0, 1, 0, float("nan"), 1, 1.0]), group_size=4)
    with pytest.raises(ValueError, match="scale = 'rank'"):
        group_advantages(torch.zeros(4), group_size=4, scale="rank")
