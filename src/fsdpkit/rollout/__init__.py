"""Online RL's rollout side: what scores the policy's completions (and, next, the
engines that sample them and the weight sync after each update).

Modules:
    rewards  the built-in rewards and users' own with TRL's reward signature, weighted
             and checked ([Note: reward functions])
    final_answer  final-answer extraction and equivalence for the math reward, math-verify
                  or the fallback ([Note: math answers])

Names are imported on first use ([Note: lazy package faces] in fsdpkit.lazy).
"""

from typing import TYPE_CHECKING

from fsdpkit.lazy import lazy_exports

if TYPE_CHECKING:
    from fsdpkit.rollout.rewards import (
        RewardError,
        RewardFn,
        Rewards,
        RewardState,
        Scores,
        build_rewards,
    )

__all__ = ["RewardError", "RewardFn", "RewardState", "Rewards", "Scores", "build_rewards"]
_HOMES = dict.fromkeys(__all__, "fsdpkit.rollout.rewards")
__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
