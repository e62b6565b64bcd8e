"""The ``[rl]`` section's rules against the rest of a run's config (the section itself,
its fields and own ranges: fsdpkit.config.rl); fsdpkit.config.validate calls
``validate_rl`` before any worker starts; the trainer and the planner resolve the run's
length through ``with_rl_context``."""

from __future__ import annotations

import dataclasses

from fsdpkit.config.rl import AXES, check_grpo_batch, check_section
from fsdpkit.config.schema import RunConfig
from fsdpkit.errors import ConfigError


def validate_rl(cfg: RunConfig) -> None:
    """The ``[rl]`` section's ranges (always) and, under ``train.objective = grpo``, its
    needs from the rest of the config; a ConfigError names the key and the fix."""
    rl = cfg.rl
    check_section(rl)
    if cfg.train.objective == "grpo":
        _grpo_run(cfg)
        if rl.engine == "vllm":
            _vllm_run(cfg)


def _grpo_run(cfg: RunConfig) -> None:
    """What ``train.objective = grpo`` needs from the other sections."""
    for axis in AXES:
        degree = getattr(cfg.parallel, axis)
        if degree > 1:
            raise ConfigError(
                f"parallel.{axis} = {degree} is not supported with train.objective = "
                "'grpo' yet: rollouts and their log-probs run under data parallelism only. "
                f"Set parallel.{axis} = 1 (FSDP shards the model over every rank), or train "
                "another objective."
            )
    if cfg.train.compile:
        raise ConfigError(
            "train.compile = true is not supported with train.objective = 'grpo' yet: "
            "rollouts decode one token per forward at a new length each time, which a "
            "compiled model would recompile for. Set train.compile = false."
        )
    if cfg.train.global_batch_size is not None:
        check_grpo_batch(cfg.rl, global_batch=cfg.train.global_batch_size)
    if not cfg.rl.rewards:
        raise ConfigError(
            "train.objective = 'grpo' needs at least one reward: set rl.rewards, e.g. "
            'rl.rewards=["math"] (built-ins: math, exact, format, length) or '
            '["mypkg.rewards:my_reward"].'
        )
    if not cfg.data.path or cfg.data.mix:
        raise ConfigError(
            "train.objective = 'grpo' samples completions for prompts, so data.path must "
            "name a file or directory of rows with a 'prompt' (a string or chat messages) "
            "and the columns the rewards read (data.mix is not supported for prompts); "
            "see docs/rl.md."
        )


def with_rl_context(cfg: RunConfig) -> RunConfig:
    """Under ``train.objective = grpo`` a prompt and its completion are one sequence of
    the model: ``data.seq_len`` (the built-in models' context, what the planner plans)
    raised to rl.max_prompt_length + rl.max_completion_length when shorter. The
    trainer and the planner both resolve the run's length through this."""
    need = cfg.rl.max_prompt_length + cfg.rl.max_completion_length
    if cfg.train.objective != "grpo" or cfg.data.seq_len >= need:
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=need))


def _vllm_run(cfg: RunConfig) -> None:
    """What ``rl.engine = vllm`` needs (docs/rl-vllm.md)."""
    rl = cfg.rl
    if rl.top_k or rl.top_p < 1:
        raise ConfigError(
            f"rl.top_k = {rl.top_k} / rl.top_p = {rl.top_p:g} is not supported with rl.engine "
            "= 'vllm' yet: vLLM 0.32 reports a sampled token's log-prob after top-k / top-p "
            "renormalized the distribution (logprobs_mode = processed_logprobs), not the "
            "whole-vocabulary log-prob the trainer recomputes, so the log-prob gap would "
            "compare two different numbers. Set rl.top_k = 0 and rl.top_p = 1.0 (TRL's "
            "defaults), or use rl.engine = 'embedded'."
        )
    if cfg.model.factory:
        raise ConfigError(
            f"model.factory = {cfg.model.factory!r} cannot be served by rl.engine = 'vllm': "
            "vLLM builds the model from a Hugging Face config.json of an architecture it "
            "implements. Use model.hf (a Hugging Face directory) or a built-in model.preset, "
            "or rl.engine = 'embedded'."
        )
    low, high = rl.vllm_importance_sampling_clip_min, rl.vllm_importance_sampling_clip_max
    if low < 0 or low >= high:
        raise ConfigError(
            f"rl.vllm_importance_sampling_clip_min = {low} must be >= 0 and below "
            f"rl.vllm_importance_sampling_clip_max = {high} (the ratio's bounds)."
        )
