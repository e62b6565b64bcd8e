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

if TYPE_CHECKING:  # the names of _HOMES from their modules (tests/unit/test_lazy_faces.py)
    from fsdpkit.rollout.rewards import RewardError as RewardError
    from fsdpkit.rollout.rewards import RewardFn as RewardFn
    from fsdpkit.rollout.rewards import Rewards as Rewards
    from fsdpkit.rollout.rewards import RewardState as RewardState
    from fsdpkit.rollout.rewards import Scores as Scores
    from fsdpkit.rollout.rewards import build_rewards as build_rewards

_HOMES = dict.fromkeys(
    ["RewardError", "RewardFn", "RewardState", "Rewards", "Scores", "build_rewards"],
    "fsdpkit.rollout.rewards",
)
"""Where each public name lives: the one list of them ([Note: lazy package faces] in
fsdpkit.lazy)."""

__all__ = sorted(_HOMES)
__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
