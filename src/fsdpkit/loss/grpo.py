"""The GRPO family's clipped policy-gradient losses over per-token log-probs, as TRL
1.16's GRPOTrainer computes them, normalized so that ranks and micro-batches add up to
the one-process loss of the whole batch.

[Note: GRPO policy losses]
Per completion ``i`` and token ``t`` (``m`` the completion mask, ``A_i`` the advantage,
``logp`` the current policy's log-prob, ``old`` the sampling policy's, detached ``logp``
when there is none: one update per rollout batch), the ratio is ``w_it = exp(logp_it -
old_it)`` (``importance_sampling_level = "token"``) or GSPO's one ratio per completion
``w_i = exp(sum_t m (logp - old) / max(|o_i|, 1))`` (``"sequence"``). The per-token loss:

- grpo, dr_grpo, dapo, bnpo, luspo: ``-min(w A, clip(w, 1 - eps_low, 1 + eps_high) A)``
  (``eps_high > eps_low`` is DAPO's clip-higher); with ``delta``, INTELLECT-2's two-sided
  clip, the unclipped ``w`` is first capped at ``delta``;
- cispo (MiniMax-M1): ``-sg(min(w, eps_high)) A logp``, the ratio clipped and detached;
- sapo: ``-sigmoid(tau (w - 1)) 4 / tau A`` with ``tau`` ``sapo_temperature_pos`` where
  ``A > 0``, else ``sapo_temperature_neg``;

plus ``beta`` times the k3 estimator of KL(pi || ref), ``exp(ref - logp) - (ref - logp)
- 1``, multiplied by ``w`` when ``use_bias_correction_kl`` (TRL's default). The
variants differ in how the masked per-token losses ``l_it m_it`` are summed and
normalized ([Note: GRPO loss normalization]). Not offered: vespo, TRL's off-policy
sequence mask, its top-entropy token mask and its entropy bonus. vLLM's importance
sampling correction is ``engine_sampling_weights`` ([Note: engine importance
sampling]).

Metrics, as TRL logs them, as ``[sum, count]`` pairs that add over ranks and
micro-batches (``metric_means`` divides): ``clip_ratio/{low,high,region}_mean`` (clipped
family: tokens, or completions at sequence level, whose ratio left the clip range on
the side where the clip binds), ``cispo_clip_ratio``, ``kl`` (mean k3 over completion
tokens, logged whenever ``ref_logps`` is given) and ``entropy`` (when given).

[Note: GRPO loss normalization]
One optimizer step trains on a global batch of N completions (every completion of the
step, masked ones included) holding M active tokens, split over dp ranks and
micro-batches. Over the whole batch, in one process, each variant is one sum divided by
one number:

- grpo, sapo:     sum_i (sum_t l_it m_it / max(|o_i|, 1)) / N
- luspo:          sum_it l_it m_it / N      (GSPO scaled by each completion's length)
- bnpo, dapo, cispo:  sum_it l_it m_it / max(M, 1)
- dr_grpo:        sum_it l_it m_it / (N * max_completion_length)

The numerators add over completions, so a micro-batch's contribution is its own
numerator divided by the denominator of the GLOBAL batch (``loss_denominator`` from
global N, M and the length cap; M takes one all-reduce of the ranks' token counts
before the first micro-batch): the contributions of every micro-batch on every rank add
up to the one-process loss, to float summation order, and their gradients to its
gradient. Gradient accumulation adds micro-batch gradients, so nothing is divided by
the accumulation steps. FSDP averages gradients over the dp ranks, so the trainer
multiplies a rank's contribution by the dp world size: the average of the ranks'
``world * sum of contributions`` gradients is the gradient of the global sum.

TRL normalizes per process and per micro-batch instead: for grpo, sapo, luspo and
dr_grpo it divides by the micro-batch's own completion count and by the accumulation
steps (DDP then averages over processes), which equals the rule above when every
micro-batch holds the same number of completions; bnpo is the mean over each
micro-batch's own active tokens, averaged over micro-batches and processes, which
differs from the global token mean whenever micro-batches hold different numbers of
tokens; dapo and cispo divide by the generation batch's global token count (scaled by
processes and accumulation steps), equal to ours when a generation batch is one
optimizer step. Our rule is the one-process formula over the global batch, so a run's
loss does not depend on its world size or accumulation; TRL's loss equals ours when TRL
runs one process with no accumulation (tests/unit/test_grpo_loss.py checks that per
variant, and the split property above).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fsdpkit.config.rl import LOSS_TYPES

LEVELS = ("token", "sequence")
PER_SEQUENCE_MEAN = frozenset({"grpo", "sapo"})
"""Variants that average each completion's token losses before summing completions."""
BY_SEQUENCES = frozenset({"grpo", "sapo", "luspo"})
BY_TOKENS = frozenset({"bnpo", "dapo", "cispo"})
CLIPPED = frozenset({"grpo", "dr_grpo", "dapo", "bnpo", "luspo"})
"""Variants with the PPO two-sided clipped surrogate (and its clip-ratio metrics)."""


@dataclass(frozen=True)
class PolicyLoss:
    """One micro-batch's share of the step's loss and its metrics."""

    loss: torch.Tensor
    """This micro-batch's numerator over the global denominator ([Note: GRPO loss
    normalization]); the step's loss is the sum over micro-batches and ranks."""
    metrics: dict[str, torch.Tensor]
    """Name -> detached ``[sum, count]``: add over micro-batches and ranks, then
    ``metric_means``."""


def loss_denominator(
    *,
    loss_type: str,
    num_sequences: int,
    num_tokens: int,
    max_completion_length: int | None = None,
) -> float:
    """The number ``loss_type`` divides its global sum by ([Note: GRPO loss
    normalization]): counts of the step's whole batch, over every rank."""
    _check_choice("loss_type", loss_type, LOSS_TYPES)
    if num_sequences < 1:
        raise ValueError(f"num_sequences = {num_sequences}: a step trains on completions")
    if loss_type in BY_SEQUENCES:
        return float(num_sequences)
    if loss_type in BY_TOKENS:
        return float(max(num_tokens, 1))
    if max_completion_length is None or max_completion_length < 1:
        raise ValueError(
            f"loss_type = 'dr_grpo' divides by num_sequences x max_completion_length; "
            f"max_completion_length = {max_completion_length} must be the positive cap on "
            "new tokens the completions were sampled with"
        )
    return float(num_sequences * max_completion_length)


def metric_means(metrics: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """``[sum, count]`` pairs (summed over micro-batches and ranks) -> means."""
    return {name: (pair[0] / pair[1].clamp(min=1)).item() for name, pair in metrics.items()}


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} = {value!r} is not one of {', '.join(choices)}")


def _check_shapes(logps: torch.Tensor, **others: torch.Tensor | None) -> None:
    """Every (B, T) tensor matches ``logps``; advantages are (B,)."""
    if logps.dim() != 2:
        raise ValueError(f"logps of shape {tuple(logps.shape)} must be (completions, tokens)")
    for name, tensor in others.items():
        want = logps.shape[:1] if name == "advantages" else logps.shape
        if tensor is not None and tensor.shape != want:
            raise ValueError(
                f"{name} of shape {tuple(tensor.shape)} does not match logps of shape "
                f"{tuple(logps.shape)}: expected {tuple(want)}"
            )


def _log_weights(log_ratio: torch.Tensor, mask: torch.Tensor, *, level: str) -> torch.Tensor:
    """log w: per token (B, T), or GSPO's per-completion mean over its tokens (B, 1)."""
    if level == "token":
        return log_ratio
    return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)


def _pair(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[sum, count] of ``values`` over the completion tokens, or over completions when
    ``values`` holds one per completion (B, 1), as TRL's global masked mean."""
    values = values.detach().to(mask.dtype)
    if values.shape != mask.shape:
        return torch.stack([values.sum(), mask.new_tensor(float(values.shape[0]))])
    return torch.stack([(values * mask).sum(), mask.sum()])


def _surrogate(
    ratio: torch.Tensor,
    logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None,
    sapo_temperatures: tuple[float, float],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy term per token (or per completion) and its clip metrics
    ([Note: GRPO policy losses])."""
    if loss_type == "cispo":
        capped = torch.clamp(ratio, max=epsilon_high).detach()
        clipped = (ratio > epsilon_high) & (advantages > 0)
        return -capped * advantages * logps, {"cispo_clip_ratio": _pair(clipped, mask)}
    if loss_type == "sapo":
        positive, negative = sapo_temperatures
        tau = torch.where(advantages > 0, positive, negative)
        return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages, {}
    bounded = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        ratio = torch.clamp(ratio, max=delta)
    low = (ratio < 1 - epsilon_low) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    metrics = {
        "clip_ratio/low_mean": _pair(low, mask),
        "clip_ratio/high_mean": _pair(high, mask),
        "clip_ratio/region_mean": _pair(low | high, mask),
    }
    return -torch.min(ratio * advantages, bounded * advantages), metrics


def _numerator(per_token: torch.Tensor, mask: torch.Tensor, *, loss_type: str) -> torch.Tensor:
    """The micro-batch's share of the global sum ([Note: GRPO loss normalization])."""
    masked = per_token * mask
    if loss_type in PER_SEQUENCE_MEAN:
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    return masked.sum()


def policy_loss(
    logps: torch.Tensor,
    *,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    denominator: float,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    importance_sampling_level: str = "token",
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    use_bias_correction_kl: bool = True,
    delta: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    entropy: torch.Tensor | None = None,
    sampling_weights: torch.Tensor | None = None,
) -> PolicyLoss:
    """One micro-batch's ``loss_type`` loss ([Note: GRPO policy losses]) over its
    completions' per-token ``logps`` (B, T), divided by the global ``denominator``
    (``loss_denominator``). ``old_logps`` None means one update per rollout: the ratio is
    1 with the policy's gradient. ``sampling_weights`` (B, T) or (B, 1): the rollout
    engine's importance weights (``engine_sampling_weights``), multiplying each token's
    policy loss (not the KL term), as TRL's vLLM correction does. Defaults are TRL
    1.16's GRPOConfig defaults."""
    _check_choice("loss_type", loss_type, LOSS_TYPES)
    _check_choice("importance_sampling_level", importance_sampling_level, LEVELS)
    _check_shapes(
        logps,
        old_logps=old_logps,
        advantages=advantages,
        mask=mask,
        ref_logps=ref_logps,
        entropy=entropy,
    )
    if beta != 0.0 and ref_logps is None:
        raise ValueError(f"beta = {beta} weighs a KL to the reference: pass ref_logps")
    if not denominator > 0:
        raise ValueError(f"denominator = {denominator} must be positive (loss_denominator)")
    mask = mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(_log_weights(logps - old, mask, level=importance_sampling_level))
    per_token, metrics = _surrogate(
        ratio,
        logps,
        advantages.unsqueeze(1),
        mask,
        loss_type=loss_type,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        delta=delta,
        sapo_temperatures=(sapo_temperature_pos, sapo_temperature_neg),
    )
    if sampling_weights is not None:
        per_token = per_token * sampling_weights
        metrics["engine_is_ratio"] = _pair(sampling_weights.expand_as(mask), mask)
    if ref_logps is not None:
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        kl = kl * ratio if use_bias_correction_kl else kl
        metrics["kl"] = _pair(kl, mask)
        if beta != 0.0:
            per_token = per_token + beta * kl
    if entropy is not None:
        metrics["entropy"] = _pair(entropy, mask)
    loss = _numerator(per_token, mask, loss_type=loss_type) / denominator
    return PolicyLoss(loss=loss, metrics=metrics)


IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def engine_sampling_weights(
    trainer_logps: torch.Tensor,
    engine_logps: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> torch.Tensor:
    """Truncated importance weights for an engine that samples with other kernels than
    the trainer's (TRL 1.16's vllm_importance_sampling_correction, verl's TIS).

    [Note: engine importance sampling]
    The rollout engine samples from its own numerics' distribution, ``q``; the trainer's
    recomputation with the same weights, ``p_old``, is what the loss's ratio starts
    from. ``w = p_old / q = exp(trainer - engine)`` per token (``token_*``), or per
    completion as the product over its tokens, ``exp(sum_t m (trainer - engine))``
    (``sequence_*``: (B, 1)); ``*_truncate`` clamps ``w`` into [clip_min, clip_max],
    ``*_mask`` sets it to 0 outside. Detached: a weight, not a gradient path. The
    log-prob gap guard stops a step whose largest per-token difference exceeds
    rl.logprob_gap_max, so with the default limits ``w`` is within ~1e-3 of 1 in fp32;
    the correction matters for bf16 engines whose kernels differ from the trainer's."""
    _check_choice("mode", mode, IS_MODES)
    diff = ((trainer_logps - engine_logps) * mask).detach().float()
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    weights = torch.exp(diff)
    low = clip_min if clip_min is not None else 0.0
    high = clip_max if clip_max is not None else float("inf")
    if mode.endswith("truncate"):
        return weights.clamp(min=low, max=high)
    return weights.masked_fill((weights < low) | (weights > high), 0.0)
