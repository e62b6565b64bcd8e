"""The ``[rl]`` section of a run's configuration: online reinforcement learning with
verifiable rewards (``train.objective = grpo``). Data only, like the rest of
``fsdpkit.config.schema``, which assembles it into ``RunConfig``; ``check_section`` holds
the section's own rules, and fsdpkit.config.rl_rules its rules against the other
sections (``validate_rl``, which fsdpkit.config.validate calls before any worker starts).

Field names are TRL 1.16 ``GRPOConfig``'s where it has one (num_generations,
max_completion_length, temperature, top_p, top_k, loss_type, epsilon, epsilon_high, beta,
scale_rewards, num_iterations, mask_truncated_completions, importance_sampling_level,
reward_weights), so a TRL user's values carry over as they are.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal

from fsdpkit.config.coerce import suggest
from fsdpkit.errors import ConfigError

LOSS_TYPES: tuple[str, ...] = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo")
"""The ``rl.loss_type`` values a run takes: the one list (fsdpkit.loss.grpo implements
each; a variant joins here when its formula and its TRL parity test exist)."""
TRL_ONLY_LOSS_TYPES = ("vespo",)
"""TRL 1.16 loss types fsdpkit does not offer (yet): refused by name."""
BUILTIN_REWARDS: tuple[str, ...] = ("math", "exact", "format", "length")
"""Built-in reward names (fsdpkit.rollout.rewards implements each; a unit test checks
that the two lists agree)."""
AXES = ("tp", "cp", "pp", "ep")
"""Parallel axes a GRPO run does not compose with (yet): refused by key."""
DEFAULT_FORMAT = r"<think>.*?</think>\s*<answer>.*?</answer>"
"""DeepSeek-R1's reasoning format: a think block, then an answer block."""


@dataclass(frozen=True)
class RlConfig:
    num_generations: int = 8
    """Completions sampled per prompt (TRL's G): advantages compare each completion
    with the others of its prompt's group, so at least 2."""
    max_completion_length: int = 256
    """New tokens a completion may have; a completion still going at this length is
    truncated (see rl.mask_truncated_completions)."""
    max_prompt_length: int = 512
    """Prompt tokens (after the chat template) a prompt may have; longer prompts are
    left out of training, counted in the run's first lines, never cut (a cut question
    would be graded against the whole question's answer)."""
    temperature: float = 1.0
    """Sampling temperature (> 0): logits are divided by it before sampling."""
    top_p: float = 1.0
    """Nucleus sampling: sample from the smallest set of tokens whose probabilities add
    up to top_p, in (0, 1]; 1 = all tokens."""
    top_k: int = 0
    """Sample from the k most likely tokens only; 0 = off (all tokens)."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a completion (besides the tokenizer's EOS token), e.g.
    ["</answer>"]; the completion keeps the stop string."""
    loss_type: str = "dapo"
    """The policy-gradient loss (TRL 1.16's names): grpo (each completion's token mean,
    then the mean over completions), dr_grpo (the token sum over completions x
    max_completion_length), dapo (the mean over the completion tokens of the whole step,
    all ranks), bnpo (as dapo here: fsdpkit normalizes over the global batch, so its loss
    does not change with the world size), cispo (MiniMax-M1: the clipped, detached
    ratio times the log-prob), sapo (a soft sigmoid gate instead of the clip), luspo
    (GSPO scaled by each completion's length; use with importance_sampling_level =
    sequence). See [Note: GRPO loss normalization] in fsdpkit.loss.grpo and docs/rl.md."""
    epsilon: float = 0.2
    """Clipping range of the importance ratio: [1 - epsilon, 1 + epsilon_high]."""
    epsilon_high: float | None = None
    """Upper clipping range (DAPO's clip-higher; the paper uses 0.28); empty = epsilon.
    Must be >= rl.epsilon."""
    beta: float = 0.0
    """Weight of the KL penalty (k3 estimator) to the reference model; 0 = off and no
    reference model is built (as TRL's default). DeepSeek-R1 used 0.001."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantage = reward - its group's mean, divided by: group = the group's standard
    deviation; batch = the whole step's; none = not divided (Dr. GRPO)."""
    num_iterations: int = 1
    """Optimizer updates per batch of rollouts (TRL's mu); > 1 reuses the samples, the
    importance ratio correcting for the policy having moved."""
    mask_truncated_completions: bool = False
    """Leave completions that hit rl.max_completion_length without ending out of the
    loss (DAPO's overlong filtering)."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """token: one importance ratio per token; sequence: the geometric mean over the
    completion's tokens, one ratio per completion (GSPO)."""
    rewards: list[str] = field(default_factory=list)
    """Reward functions, summed with rl.reward_weights: built-ins math (final-answer
    equivalence against the row's answer / ground_truth / solution), exact (completion ==
    answer after strip), format (rl.format_pattern), length (DAPO's soft overlong
    penalty), or your own "package.module:function" with TRL's reward signature
    fn(prompts, completions, completion_ids, **columns) -> list[float]. See docs/rl.md."""
    reward_weights: list[float] = field(default_factory=list)
    """One weight per entry of rl.rewards (the total reward is sum w_i r_i); empty =
    1.0 each."""
    format_pattern: str = DEFAULT_FORMAT
    """The regular expression the format reward checks: 1.0 when the whole completion
    (stripped) matches it, '.' matching newlines too, else 0.0."""
    soft_punish_cache: int | None = None
    """The length reward's cache L_cache (DAPO): 0 up to max_completion_length -
    L_cache tokens, then falling linearly to -1 at max_completion_length; empty =
    max_completion_length // 4."""
    logprob_gap_max: float | None = None
    """Stop the run when the largest per-token |engine - trainer| log-prob gap of a
    step's sampled tokens exceeds this (nats); empty = by the run's compute dtype: 1e-3
    in fp32, 0.1 in bf16 / fp16 (gap_limit). The embedded engine samples with the
    weights the trainer recomputes with, so the gap is float noise (measured on CPU,
    fp32 and bf16: <= 1e-6 on the tiny models of tests/distributed/test_grpo.py), while a
    stale or broken weight update shows as whole nats (a public FSDP report: 0.017
    healthy, 66.5 after two broken steps). bf16 kernels on a GPU (another attention
    kernel for decoding than for the full forward) have not been measured: read
    rl/logprob_gap_max in a run's metrics and set this above it if a healthy run stops."""
    engine: Literal["embedded", "vllm"] = "embedded"
    """What samples the rollouts: embedded = the policy being trained, sharded as it
    trains (KV cache, no second copy); vllm = a vLLM engine beside each data-parallel
    rank, its weights pushed from the shards after every update and checked by the
    same log-prob gap (the `vllm` extra; docs/rl-vllm.md)."""
    vllm_python: str = ""
    """rl.engine = vllm: the Python interpreter that runs the engine; empty = the
    trainer's own. vLLM pins its own transformers (vllm 0.32: < 5.20), so the engine may
    live in an environment of its own: `make vllm-venv` builds .venv-vllm, then
    rl.vllm_python = ".venv-vllm/bin/python"."""
    vllm_sync_bucket_mb: int = 256
    """rl.engine = vllm: the most weight bytes gathered whole at once while the weights
    are pushed to the engine (one tensor larger than this goes alone): a rank never holds
    the whole model unsharded."""
    vllm_kv_cache_mb: int = 0
    """rl.engine = vllm: the engine's KV cache; 0 = sized to one rollout of this rank
    (its prompts x rl.num_generations sequences of max_prompt_length +
    max_completion_length tokens)."""
    vllm_enable_sleep_mode: bool = True
    """rl.engine = vllm on CUDA: the engine frees its weights and KV cache while the
    trainer steps (vLLM's sleep mode, level 2) and takes them back before the next push;
    vLLM on CPU has no sleep mode (ignored)."""
    vllm_importance_sampling_correction: bool = False
    """rl.engine = vllm: weigh each token's loss by the truncated importance ratio
    exp(trainer - engine log-prob) of the sampling policy (TRL's option of this name,
    verl's TIS), correcting for the engine's kernels differing from the trainer's
    below rl.logprob_gap_max. Off by default: the gap guard bounds the mismatch."""
    vllm_importance_sampling_mode: Literal[
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
    ] = "sequence_mask"
    """token_*: one ratio per token; sequence_*: one per completion (the product of its
    tokens' ratios). *_truncate clips the ratio into [clip_min, clip_max]; *_mask sets
    it to 0 outside (TRL's modes and default)."""
    vllm_importance_sampling_clip_min: float = 0.0
    """Lower bound of the importance ratio (0.0 = none: a ratio is never negative)."""
    vllm_importance_sampling_clip_max: float = 3.0
    """Upper bound of the importance ratio (TRL's default 3.0; inf = none). A plain
    number rather than an optional one: a config written back reads the same."""


def check_section(rl: RlConfig) -> None:
    """The section's own rules (ranges, loss type, reward specs, engine)."""
    _ranges(rl)
    _losses(rl)
    _reward_specs(rl)


def _ranges(rl: RlConfig) -> None:
    checks = [
        ("num_generations", rl.num_generations >= 2, "must be >= 2 (advantages compare each "
         "completion with the others of its prompt)"),
        ("max_completion_length", rl.max_completion_length > 0, "must be > 0"),
        ("max_prompt_length", rl.max_prompt_length > 0, "must be > 0"),
        ("temperature", rl.temperature > 0, "must be > 0 (it divides the logits)"),
        ("top_p", 0 < rl.top_p <= 1, "must be in (0, 1]"),
        ("top_k", rl.top_k >= 0, "must be >= 0 (0 = off)"),
        ("epsilon", rl.epsilon > 0, "must be > 0"),
        ("beta", rl.beta >= 0, "must be >= 0 (0 = no KL term)"),
        ("num_iterations", rl.num_iterations >= 1, "must be >= 1"),
        ("logprob_gap_max", rl.logprob_gap_max is None or rl.logprob_gap_max > 0, "must be > 0"),
        ("vllm_sync_bucket_mb", rl.vllm_sync_bucket_mb > 0, "must be > 0"),
        ("vllm_kv_cache_mb", rl.vllm_kv_cache_mb >= 0, "must be >= 0 (0 = sized to a rollout)"),
    ]  # fmt: skip
    for key, ok, rule in checks:
        if not ok:
            raise ConfigError(f"rl.{key} = {getattr(rl, key)} {rule}.")
    if rl.epsilon_high is not None and rl.epsilon_high < rl.epsilon:
        raise ConfigError(
            f"rl.epsilon_high = {rl.epsilon_high} is below rl.epsilon = {rl.epsilon}: the "
            "upper clipping range must be at least the lower one (DAPO's clip-higher "
            "raises it, e.g. 0.28). Raise rl.epsilon_high, or leave it empty (= rl.epsilon)."
        )
    cache = rl.soft_punish_cache
    if cache is not None and not 0 < cache <= rl.max_completion_length:
        raise ConfigError(
            f"rl.soft_punish_cache = {cache} must be in (0, rl.max_completion_length = "
            f"{rl.max_completion_length}]: it is how many tokens before the limit the "
            "length penalty starts. Leave it empty for max_completion_length // 4."
        )
    if any(not s for s in rl.stop):
        raise ConfigError(f"rl.stop = {rl.stop} holds an empty string, which would stop at once.")


def _losses(rl: RlConfig) -> None:
    if rl.loss_type in LOSS_TYPES:
        return
    if rl.loss_type in TRL_ONLY_LOSS_TYPES:
        raise ConfigError(
            f"rl.loss_type = {rl.loss_type!r} is one of TRL's losses fsdpkit does not offer "
            f"yet. Choose one of {', '.join(LOSS_TYPES)} (dapo is TRL's default)."
        )
    raise ConfigError(
        f"rl.loss_type = {rl.loss_type!r} is not a loss type."
        f"{suggest(rl.loss_type, list(LOSS_TYPES))}"
    )


def _reward_specs(rl: RlConfig) -> None:
    """Each rl.rewards entry is a built-in name or "package.module:function"."""
    for i, name in enumerate(rl.rewards):
        if ":" in name:
            module, _, attr = name.partition(":")
            parts = [*module.split("."), attr]
            if not all(p.isidentifier() for p in parts):
                raise ConfigError(
                    f"rl.rewards[{i}] = {name!r} must look like 'package.module:function' "
                    "(a module on PYTHONPATH and a function in it)."
                )
        elif name not in BUILTIN_REWARDS:
            raise ConfigError(
                f"rl.rewards[{i}] = {name!r} is not a built-in reward."
                f"{suggest(name, list(BUILTIN_REWARDS))} Your own function is named "
                "'package.module:function'."
            )
    repeated = sorted({n for n in rl.rewards if rl.rewards.count(n) > 1})
    if repeated:
        raise ConfigError(
            f"rl.rewards names {repeated[0]!r} twice; weigh one entry with rl.reward_weights "
            "instead."
        )
    weights = rl.reward_weights
    if weights and len(weights) != len(rl.rewards):
        raise ConfigError(
            f"rl.reward_weights has {len(weights)} weight(s) but rl.rewards has "
            f"{len(rl.rewards)} reward(s) ({', '.join(rl.rewards) or 'none'}): give one "
            "weight per reward, in the same order, or leave rl.reward_weights empty (1.0 each)."
        )
    bad = [w for w in weights if not math.isfinite(w)]
    if bad:
        raise ConfigError(f"rl.reward_weights must be finite numbers, got {bad[0]}.")
    try:
        re.compile(rl.format_pattern)
    except re.error as exc:
        raise ConfigError(
            f"rl.format_pattern = {rl.format_pattern!r} is not a valid regular expression "
            f"({exc}). Fix it (Python's re syntax), or leave the default."
        ) from None


def gap_limit(rl: RlConfig, *, low_precision: bool) -> float:
    """rl.logprob_gap_max, or its default for the run's compute dtype."""
    if rl.logprob_gap_max is not None:
        return rl.logprob_gap_max
    return 0.1 if low_precision else 1e-3


def check_grpo_batch(rl: RlConfig, *, global_batch: int) -> None:
    """``train.global_batch_size`` counts completions: whole groups of
    rl.num_generations ([Note: the GRPO step] in fsdpkit.train.rl_step)."""
    if global_batch % rl.num_generations:
        raise ConfigError(
            f"train.global_batch_size = {global_batch} is not a multiple of "
            f"rl.num_generations = {rl.num_generations}: under train.objective = 'grpo' "
            "the global batch counts completions, num_generations per prompt. Use a "
            f"multiple of {rl.num_generations} (e.g. "
            f"{max(1, global_batch // rl.num_generations) * rl.num_generations})."
        )
