"""Online RL's rollout side: the engines that sample the policy's completions, and what
scores them.

Modules:
    sampling         the settings, one seed per completion, the Gumbel-max draw ([Note:
                     world-size-independent samples])
    decoding         KV-cache decoding of built-in and transformers models ([Note:
                     decoding with a KV cache])
    embedded         the embedded engine: the sharded policy gathered whole per rollout
                     ([Note: the embedded engine])
    vllm/            rl.engine = vllm: an engine process per rank, weights pushed from the
                     shards ([Note: the vLLM engine])
    completion_rows  sampled completions laid out for the trainer ([Note: rollout batches])
    gap              the engine's log-probs against the trainer's ([Note: the log-prob gap])
    rewards          the built-in rewards and users' own with TRL's reward signature,
                     weighted and checked ([Note: reward functions])
    final_answer     final-answer extraction and equivalence for the math reward,
                     math-verify or the fallback ([Note: math answers])

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
