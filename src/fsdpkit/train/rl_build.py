"""A GRPO session's rollout side, built once: the engine that samples (rl.engine),
the sampling settings, the rewards, the gap limit; and the run's first lines about it.

The engine is the embedded one ([Note: the embedded engine]) or, with rl.engine =
vllm, a vLLM engine process beside each rank ([Note: the vLLM engine] in
fsdpkit.rollout.vllm.engine), started here and stopped when the run ends
(fsdpkit.train.loop). With vLLM the step also reports the weight push
(``sync_metrics``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fsdpkit.config import ConfigError, RunConfig
from fsdpkit.config.rl import gap_limit
from fsdpkit.data.tokenizer import Tokenizer
from fsdpkit.models.hf.directory import read_hf_dir
from fsdpkit.rollout.embedded import EmbeddedEngine, RolloutEngine
from fsdpkit.rollout.rewards import Rewards
from fsdpkit.rollout.sampling import Sampling
from fsdpkit.train.rl_step import RlRun


def build_engine(
    cfg: RunConfig,
    *,
    model: nn.Module,
    device: torch.device,
    decode: Callable[[list[int]], str],
    dtype: torch.dtype,
) -> RolloutEngine:
    """rl.engine's engine over the sharded policy (collective for vllm: every rank
    starts its own and waits for all)."""
    if cfg.rl.engine == "vllm":
        from fsdpkit.rollout.vllm.start import start_vllm

        return start_vllm(cfg, model=model, device=device, dtype=dtype, decode=decode)
    return EmbeddedEngine(model, device=device, decode=decode)


SYNC_KEYS = ("rl/sync_s", "rl/sync_bytes", "rl/sync_tensors")


def sync_metrics(cfg: RunConfig, local: dict[str, float]) -> dict[str, float]:
    """The step's weight pushes (rl.engine = vllm: the slowest rank's seconds, one
    engine's bytes and tensors); collective under vllm, {} for the embedded engine."""
    if cfg.rl.engine != "vllm":
        return {}
    values = torch.tensor([local.get(k, 0.0) for k in SYNC_KEYS], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        backend_device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        values = values.to(backend_device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    if values[1] <= 0:
        return {}
    return dict(zip(SYNC_KEYS, values.tolist()))


def stop_ids(cfg: RunConfig, tokenizer: Tokenizer) -> frozenset[int]:
    """The tokens that end a completion: the tokenizer's EOS and, for model.hf, every
    ``eos_token_id`` of the model's generation_config.json (an instruct model's end of
    turn, as transformers' ``generate`` stops at them)."""
    ids = {tokenizer.eos_id} if tokenizer.eos_id is not None else set()
    if cfg.model.hf:
        path = Path(cfg.model.hf).expanduser() / "generation_config.json"
        if path.is_file():
            found = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
            ids |= set(found if isinstance(found, list) else [found] if found is not None else [])
    return frozenset(int(i) for i in ids)


def check_lengths(cfg: RunConfig) -> None:
    """A model.hf model must hold a prompt and its completion in its positions: the
    refusal names the [rl] lengths (the run's data.seq_len is derived from them:
    fsdpkit.config.rl_rules.with_rl_context)."""
    if not cfg.model.hf:
        return
    config = read_hf_dir(cfg.model.hf).config
    positions = getattr(config, "max_position_embeddings", None) or getattr(
        config, "n_positions", None
    )
    need = cfg.rl.max_prompt_length + cfg.rl.max_completion_length
    if positions is not None and need > positions:
        raise ConfigError(
            f"rl.max_prompt_length + rl.max_completion_length = {cfg.rl.max_prompt_length} "
            f"+ {cfg.rl.max_completion_length} = {need} tokens is longer than model.hf = "
            f"{cfg.model.hf!r} supports ({positions} positions in config.json): a prompt and "
            "its completion are one sequence of the model. Lower them so they add up to at "
            f"most {positions}."
        )


def build_rl(
    cfg: RunConfig,
    *,
    model: nn.Module,
    tokenizer: Tokenizer,
    device: torch.device,
    rewards: Rewards,
    reference: nn.Module | None,
    low_precision: bool,
    compute_dtype: torch.dtype = torch.float32,
) -> RlRun:
    """A GRPO session's rollout side: the engine (rl.engine) and the rewards."""
    rl = cfg.rl
    sampling = Sampling(
        max_new_tokens=rl.max_completion_length,
        temperature=rl.temperature,
        top_p=rl.top_p,
        top_k=rl.top_k,
        stop_ids=stop_ids(cfg, tokenizer),
        stop_strings=tuple(rl.stop),
    )
    engine = build_engine(
        cfg, model=model, device=device, decode=tokenizer.decode, dtype=compute_dtype
    )
    limit = gap_limit(rl, low_precision=low_precision)
    return RlRun(
        engine, rewards, sampling, tokenizer, reference, lora=bool(cfg.lora.rank), gap_limit=limit
    )


def describe(run: RlRun, cfg: RunConfig) -> str:
    """The run's first lines about GRPO."""
    rl, s = cfg.rl, run.sampling
    stops = f"{len(s.stop_ids)} stop token(s)" + (
        f", stop strings {list(s.stop_strings)}" if s.stop_strings else ""
    )
    kl = (
        "no KL term"
        if rl.beta == 0
        else (
            f"KL to the reference x {rl.beta:g} ("
            + (
                "the base with the adapters off"
                if run.reference is None
                else "a frozen sharded copy"
            )
            + ")"
        )
    )
    return (
        f"GRPO: {rl.num_generations} completions per prompt from {run.engine.describe()}, "
        f"at most {rl.max_completion_length} tokens, "
        f"temperature {rl.temperature:g}, top-p {rl.top_p:g}, top-k {rl.top_k or 'off'}, "
        f"{stops}; {run.rewards.describe()}; loss {rl.loss_type} "
        f"({rl.importance_sampling_level} ratio, clip {rl.epsilon:g}/"
        f"{rl.epsilon_high if rl.epsilon_high is not None else rl.epsilon:g}), "
        f"{rl.num_iterations} update(s) per rollout, advantages scaled by {rl.scale_rewards}, "
        f"{kl}; train.global_batch_size counts completions; a step stops if the rollout's "
        f"log-prob gap passes rl.logprob_gap_max = {run.gap_limit:g}"
    )
