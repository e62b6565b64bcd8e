"""Preference losses over the log-probs of each pair's answers: DPO, IPO, SimPO.

[Note: preference losses]
For pair ``i`` with chosen answer ``y_w`` and rejected ``y_l`` (log-probs summed over
the answer tokens only, fp32; ``pi`` the policy, ``ref`` the frozen reference):

- ``sigmoid`` (DPO, Rafailov et al. 2023): ``h = beta * ((pi_w - ref_w) - (pi_l - ref_l))``,
  ``loss = -log sigmoid(h)``;
- ``ipo`` (Azar et al. 2023, as TRL computes it): the same margin from log-probs averaged
  over each answer's tokens, ``loss = (margin - 1 / (2 beta))^2``;
- ``simpo`` (Meng et al. 2024, reference-free): ``h = beta * (avg pi_w - avg pi_l) -
  gamma`` on length-averaged log-probs, ``loss = -log sigmoid(h)``.

Rewards (logged, never differentiated), in TRL's convention so that metrics.jsonl reads
like TRL's logs: ``beta * (pi - ref)`` of each side with the log-probs *summed* over the
answer, for DPO and IPO alike (IPO averages over the answer's tokens inside its loss
only, as TRL's DPOTrainer does); SimPO, reference-free, ``beta * avg pi`` (TRL's
CPOTrainer). Accuracy is the share of pairs whose chosen reward is the larger; the
margin is chosen minus rejected reward. The batch's loss is the mean over its pairs.

[Note: preference losses over a split sequence]
Under context parallelism each cp rank holds a slice of every row's tokens
(fsdpkit.sharding.context.batch.slice_batch): the rows (so the pairs) stay whole, the
sequence does not. A side's log-prob is a sum over its answer tokens, so each rank's
sums and answer-token counts are partial: ``whole_answers`` adds them over the cp
group (one all-reduce of the stacked policy / reference / count rows) before any
sigmoid, square or length average, and every cp rank then holds the whole batch's
losses and rewards, equal to the unsplit ones. The all-reduce is autograd's
(``funcol.all_reduce``): its backward all-reduces the sums' gradient, so each cp rank's
slice receives ``cp x dL/d(sum)``. Each rank's loss is the whole loss L, and FSDP
averages parameter gradients over the dp x cp ranks: per dp rank the cp ranks' grads
add up to ``cp x dL/dtheta`` (attention's exchange carries the cross-slice terms), and
the mean over cp brings that back to ``dL/dtheta``, the unsplit gradient. This is the
same bookkeeping as [Note: context-parallel loss normalization], with the whole loss
on every rank instead of cp x a share of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup
from torch.distributed import _functional_collectives as funcol

from fsdpkit.data.batch import IGNORE_INDEX

KINDS = ("sigmoid", "ipo", "simpo")
REFERENCE_FREE = frozenset({"simpo"})
"""Losses that need no reference model."""
LENGTH_AVERAGED = frozenset({"ipo", "simpo"})
"""Losses on log-probs averaged over each answer's tokens."""


@dataclass(frozen=True)
class PreferenceOutput:
    """One micro-batch's losses and rewards, one entry per pair."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def answer_logps(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of answer-token log-probs, answer tokens) per row of ``targets`` (fp32):
    minus the cross-entropy of each target, so ignored positions add nothing."""
    token = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).reshape(targets.shape)
    return -token.sum(-1), (targets != IGNORE_INDEX).sum(-1).float()


def whole_answers(
    policy: torch.Tensor,
    reference: torch.Tensor | None,
    counts: torch.Tensor,
    *,
    group: ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``answer_logps`` of a sequence slice -> those of the whole rows: summed over the
    context-parallel ``group`` ([Note: preference losses over a split sequence]);
    unchanged when ``group`` is None."""
    if group is None:
        return policy, reference, counts
    parts = [policy, counts] if reference is None else [policy, counts, reference]
    summed = funcol.wait_tensor(funcol.all_reduce(torch.stack(parts), "sum", group))
    whole_reference = None if reference is None else summed[2].detach()
    return summed[0], whole_reference, summed[1].detach()


def preference_loss(
    policy: torch.Tensor,
    reference: torch.Tensor | None,
    counts: torch.Tensor,
    *,
    kind: str,
    beta: float,
    gamma: float = 0.0,
) -> PreferenceOutput:
    """[Note: preference losses] of rows ``2i`` (chosen) / ``2i + 1`` (rejected):
    ``policy`` and ``reference`` are summed answer log-probs per row, ``counts`` the
    answer tokens per row."""
    if kind in REFERENCE_FREE:
        average = beta * policy / counts
        chosen, rejected = average[0::2], average[1::2]
        losses = -F.logsigmoid(chosen - rejected - gamma)
        return PreferenceOutput(losses, chosen.detach(), rejected.detach())
    if reference is None:
        raise ValueError(f"dpo.loss = {kind!r} needs the reference model's log-probs")
    ratio = policy - reference
    chosen, rejected = ratio[0::2], ratio[1::2]
    if kind == "sigmoid":
        losses = -F.logsigmoid(beta * (chosen - rejected))
    elif kind == "ipo":
        margin = chosen / counts[0::2] - rejected / counts[1::2]
        losses = (margin - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown preference loss {kind!r}; one of {', '.join(KINDS)}")
    return PreferenceOutput(losses, beta * chosen.detach(), beta * rejected.detach())
