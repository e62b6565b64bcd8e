"""One GRPO step: rollout -> rewards -> advantages -> the log-prob gap -> K updates.

[Note: the GRPO step]
Step ``s`` takes this rank's share of the step's prompts (fsdpkit.data.prompt_order)
and samples ``rl.num_generations`` completions of each with the policy itself
([Note: the embedded engine]), each from its own seeded stream ([Note:
world-size-independent samples]). The rewards score this rank's completions; their
totals are all-gathered (rank order is step order) so every rank computes the
advantages of the whole step, as one process would, and keeps its own. The trainer
recomputes every sampled token's log-prob (the sampling policy's, for the importance
ratio) and compares it with the engine's ([Note: the log-prob gap]): a gap above
``rl.logprob_gap_max`` stops the run before any update. With ``rl.beta > 0`` the
reference's log-probs join (a sharded frozen copy, or the adapters off under LoRA:
[Note: reference model]). Then ``rl.num_iterations`` optimizer updates, each over all
of this rank's micro-batches through ``train_step`` (accumulation, clipping, the
scaler as for every objective), with the loss of fsdpkit.loss.grpo over the global
batch's denominators ([Note: GRPO loss normalization]): each micro-batch's share times
the data-parallel world size, summed, not averaged, over micro-batches.

``train.global_batch_size`` counts completions (as TRL's batch sizes do): a step
samples ``global_batch_size / num_generations`` prompts, split evenly over the
data-parallel ranks, and ``train.micro_batch_size`` completions go through one forward.
The LR schedule steps once per GRPO step (its K updates share the step's LR).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdpkit.config import RunConfig
from fsdpkit.config.batch_split import BatchSplit
from fsdpkit.data.prompt_order import PromptBatch
from fsdpkit.data.tokenizer import Tokenizer
from fsdpkit.loss.advantages import group_advantages
from fsdpkit.loss.contract import logits_of
from fsdpkit.loss.grpo import engine_sampling_weights, metric_means, policy_loss
from fsdpkit.loss.logprobs import completion_logps, completion_logps_and_entropy
from fsdpkit.rollout.completion_rows import RolloutBatch, completion_logits, rollout_batch
from fsdpkit.rollout.embedded import Completion, RolloutEngine
from fsdpkit.rollout.gap import Gap
from fsdpkit.rollout.rewards import Rewards, RewardState, Scores
from fsdpkit.rollout.sampling import Sampling, completion_seed
from fsdpkit.trainable.reference import adapters_off, reshard

PASS_REWARDS = ("math", "exact")
"""Built-in rewards that grade correctness (0 or 1): their mean is the pass rate."""


@dataclass
class RlRun:
    """What a GRPO session holds beside the policy."""

    engine: RolloutEngine
    rewards: Rewards
    sampling: Sampling
    tokenizer: Tokenizer
    reference: nn.Module | None = None
    """The frozen sharded reference (rl.beta > 0 without LoRA), else None."""
    lora: bool = False
    gap_limit: float = 1e-3
    """rl.logprob_gap_max resolved for the run's compute dtype ([Note: the log-prob gap])."""

    def completion_text(self, ids: Sequence[int]) -> str:
        """What rewards read: the completion without its stop tokens."""
        return self.tokenizer.decode([t for t in ids if t not in self.sampling.stop_ids])


@dataclass(frozen=True)
class Rollout:
    """This rank's completions of one step, prompt-major (G per prompt), scored."""

    batch: PromptBatch
    completions: list[Completion]
    scores: Scores
    seconds: float
    sync: dict[str, float]
    """The engine's weight pushes before it (rl.engine = vllm), as metrics."""


def _seeds(cfg: RunConfig, batch: PromptBatch, *, step: int) -> list[list[int]]:
    g, seed = cfg.rl.num_generations, cfg.train.seed
    return [
        [completion_seed(seed=seed, step=step, position=int(p), index=j) for j in range(g)]
        for p in batch.positions
    ]


def sample(rl: RlRun, cfg: RunConfig, batch: PromptBatch, *, step: int) -> Rollout:
    """Rollouts and rewards of this rank's prompts (collective: the engine gathers, or
    the policy is pushed into it)."""
    sync = rl.engine.sync()
    start = time.perf_counter()
    groups = rl.engine.generate(
        batch.ids, seeds=_seeds(cfg, batch, step=step), sampling=rl.sampling
    )
    seconds = time.perf_counter() - start
    completions = [c for group in groups for c in group]
    texts = [rl.completion_text(c.ids) for c in completions]
    state = RewardState(global_step=step - 1, max_steps=cfg.train.steps)
    scores = rl.rewards.score(
        batch.repeat(cfg.rl.num_generations), texts, [c.ids for c in completions], state=state
    )
    return Rollout(batch, completions, scores, seconds, sync)


def gather_rewards(local: torch.Tensor) -> torch.Tensor:
    """Every rank's rewards in rank order, which is the step's prompt order (equal
    shares: [Note: prompt order])."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    return torch.cat(parts)


def micro_batches(
    rollout: Rollout,
    advantages: torch.Tensor,
    *,
    cfg: RunConfig,
    split: BatchSplit,
    device: torch.device,
) -> list[RolloutBatch]:
    """This rank's completions in ``split.micro_batch``-row micro-batches ([Note:
    rollout batches])."""
    g, size = cfg.rl.num_generations, split.micro_batch
    prompts = [row.ids for row in rollout.batch.repeat(g)]
    comps = rollout.completions
    trains = [not (cfg.rl.mask_truncated_completions and c.truncated) for c in comps]
    return [
        rollout_batch(
            prompts[i : i + size],
            [c.ids for c in comps[i : i + size]],
            [c.logps for c in comps[i : i + size]],
            advantages=advantages[i : i + size],
            trains=trains[i : i + size],
            device=device,
        )
        for i in range(0, len(comps), size)
    ]


def _logits(model: nn.Module, batch: RolloutBatch) -> torch.Tensor:
    return completion_logits(logits_of(model(batch.inputs), tokens=batch.inputs), batch.positions)


@torch.no_grad()
def recompute(model: nn.Module, batches: list[RolloutBatch], *, temperature: float) -> list[Any]:
    """The trainer's log-probs of every sampled token before any update ([Note: the
    log-prob gap]), in eval mode as the engine sampled."""
    was = model.training
    model.eval()
    try:
        return [
            completion_logps(_logits(model, b), b.completion_ids, temperature=temperature)
            for b in batches
        ]
    finally:
        model.train(was)


@torch.no_grad()
def reference_logps(
    rl: RlRun, model: nn.Module, batches: list[RolloutBatch], *, temperature: float
) -> list[torch.Tensor]:
    """The reference's log-probs (rl.beta > 0): the frozen copy, or the policy with its
    adapters off under LoRA ([Note: reference model])."""
    out = []
    for b in batches:
        if rl.reference is not None:
            logits = _logits(rl.reference, b)
            reshard(rl.reference)
        else:
            with adapters_off(model):
                logits = _logits(model, b)
        out.append(completion_logps(logits, b.completion_ids, temperature=temperature))
    return out


class GrpoLoss:
    """``loss_fn(model, batch)`` of one GRPO update: a micro-batch's share of the global
    loss times the dp world ([Note: GRPO loss normalization]); metrics kept per call."""

    def __init__(self, cfg: RunConfig, *, denominator: float, dp: int, off_policy: bool) -> None:
        self.rl, self.denominator, self.dp, self.off_policy = cfg.rl, denominator, dp, off_policy
        self.metrics: list[dict[str, torch.Tensor]] = []

    def __call__(self, model: nn.Module, batch: RolloutBatch) -> torch.Tensor:
        rl = self.rl
        logps, entropy = completion_logps_and_entropy(
            _logits(model, batch), batch.completion_ids, temperature=rl.temperature
        )
        weights = None
        if rl.engine == "vllm" and rl.vllm_importance_sampling_correction:
            assert batch.old_logps is not None
            weights = engine_sampling_weights(
                batch.old_logps, batch.engine_logps, batch.mask,
                mode=rl.vllm_importance_sampling_mode,
                clip_min=rl.vllm_importance_sampling_clip_min,
                clip_max=rl.vllm_importance_sampling_clip_max,
            )  # fmt: skip
        out = policy_loss(
            logps,
            old_logps=batch.old_logps if self.off_policy else None,
            advantages=batch.advantages,
            mask=batch.mask,
            loss_type=rl.loss_type,
            denominator=self.denominator,
            epsilon_low=rl.epsilon,
            epsilon_high=rl.epsilon_high if rl.epsilon_high is not None else rl.epsilon,
            importance_sampling_level=rl.importance_sampling_level,
            ref_logps=batch.ref_logps,
            beta=rl.beta,
            entropy=entropy,
            sampling_weights=weights,
        )
        self.metrics.append(out.metrics)
        return out.loss * self.dp


def global_counts(batches: list[RolloutBatch], *, device: torch.device) -> tuple[int, int]:
    """(completions, trained tokens) of the whole step, over every rank."""
    local = torch.tensor(
        [sum(b.shape[0] for b in batches), sum(float(b.mask.sum()) for b in batches)],
        dtype=torch.float64,
        device=device,
    )
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(local)
    return int(local[0]), int(local[1])


def summed_metrics(metrics: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """``[sum, count]`` pairs added over micro-batches, updates and ranks, as means."""
    if not metrics:
        return {}
    names = sorted(metrics[0])
    stacked = torch.stack([torch.stack([m[n] for m in metrics]).sum(0) for n in names])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stacked)
    return metric_means(dict(zip(names, stacked)))


def _everywhere(values: torch.Tensor) -> torch.Tensor:
    """Every rank's values (float64) in rank order."""
    return gather_rewards(values.to(torch.float64).contiguous())


def _reward_metrics(scores: Scores, *, prefix: str) -> dict[str, float]:
    """Each reward's mean over every rank, and the pass rate of the correctness ones."""
    out = {}
    for name, values in scores.per_reward.items():
        every = _everywhere(values)
        out[f"{prefix}rewards/{name}"] = float(every.mean())
        if name in PASS_REWARDS:
            out[f"{prefix}pass_rate"] = float((every >= 1.0).double().mean())
    return out


def rollout_metrics(
    rollout: Rollout, totals: torch.Tensor, gap: Gap, *, g: int
) -> dict[str, float]:
    """The rollout's side of a step's metrics (over every rank)."""
    comps = rollout.completions
    lengths = _everywhere(torch.tensor([len(c.ids) for c in comps]))
    truncated = _everywhere(torch.tensor([float(c.truncated) for c in comps]))
    seconds = torch.tensor([rollout.seconds], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    spread = group_advantages(totals, group_size=g, scale="none").zero_spread_share
    return {
        "rl/reward": float(totals.mean()),
        "rl/reward_std": float(totals.std()) if totals.numel() > 1 else 0.0,
        "rl/zero_spread_share": float(spread),
        "rl/completion_len_mean": float(lengths.mean()),
        "rl/completion_len_max": float(lengths.max()),
        "rl/completion_len_min": float(lengths.min()),
        "rl/truncated_share": float(truncated.mean()),
        "rl/logprob_gap_mean": gap.mean,
        "rl/logprob_gap_max": gap.max,
        "rl/rollout_tokens_per_s": float(lengths.sum()) / max(float(seconds), 1e-9),
        "rl/rollout_s": float(seconds),
    } | _reward_metrics(rollout.scores, prefix="rl/")


def held_out(rl: RlRun, cfg: RunConfig, batch: PromptBatch) -> dict[str, float]:
    """One completion per held-out prompt, seeded by the prompt's row (the same samples
    at every evaluation, so evaluations compare), scored (collective)."""
    seeds = [
        [completion_seed(seed=cfg.train.seed, step=0, position=int(r.row), index=0)]
        for r in batch.rows
    ]
    groups = rl.engine.generate(batch.ids, seeds=seeds, sampling=rl.sampling)
    completions = [group[0] for group in groups]
    texts = [rl.completion_text(c.ids) for c in completions]
    state = RewardState(global_step=0, max_steps=cfg.train.steps)
    scores = rl.rewards.score(batch.rows, texts, [c.ids for c in completions], state=state)
    metrics = _reward_metrics(scores, prefix="val_")
    return {"val_reward": float(_everywhere(scores.total).mean())} | metrics
