"""The GRPO family's losses equal TRL 1.16's own on the same tensors, and split over
ranks and micro-batches they add up to the one-process loss.

TRL is the oracle, not a copy: its ``GRPOTrainer._compute_loss`` runs unbound on a
stand-in ``self`` holding only what it reads, with ``_get_per_token_logps_and_entropies``
answering our fixed per-token log-probs (a leaf with a gradient, so gradients are
compared too). Tolerances are absolute (1e-6). Advantages: test_group_advantages.py.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from trl.trainer.grpo_trainer import GRPOTrainer

from fsdpkit.loss.grpo import (
    LOSS_TYPES,
    PolicyLoss,
    loss_denominator,
    metric_means,
    policy_loss,
)

B, T, MAX_LEN = 6, 7, 9
LENGTHS = (7, 5, 3, 1, 6, 0)
"""Completion lengths: masked tails, one fully masked completion."""
ATOL = 1e-6


def _batch(dtype: torch.dtype, *, lengths: tuple[int, ...] = LENGTHS) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = len(lengths)
    logps = -3 * torch.rand(n, T, generator=g, dtype=torch.float64)
    return {
        "logps": logps.to(dtype),
        "old": (logps + 0.3 * torch.randn(n, T, generator=g, dtype=torch.float64)).to(dtype),
        "ref": (logps + 0.2 * torch.randn(n, T, generator=g, dtype=torch.float64)).to(dtype),
        "advantages": torch.randn(n, generator=g, dtype=torch.float64).to(dtype),
        "entropy": (2 * torch.rand(n, T, generator=g, dtype=torch.float64)).to(dtype),
        "mask": (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long(),
    }


def _variant(loss_type: str, level: str, beta: float, **extra: Any) -> dict[str, Any]:
    return {
        "loss_type": loss_type,
        "importance_sampling_level": level,
        "beta": beta,
        "epsilon_low": 0.2,
        "epsilon_high": 1.25 if loss_type == "cispo" else 0.28,  # cispo: a cap on the ratio
        "use_bias_correction_kl": extra.get("use_bias_correction_kl", True),
        "delta": extra.get("delta"),
    }


VARIANTS = [
    _variant(loss, level, beta)
    for loss in LOSS_TYPES
    for level in ("token", "sequence")
    for beta in (0.0, 0.04)
] + [
    _variant("grpo", "token", 0.04, use_bias_correction_kl=False),
    _variant("dapo", "sequence", 0.04, use_bias_correction_kl=False),
    _variant("grpo", "token", 0.0, delta=1.3),
    _variant("dapo", "token", 0.04, delta=1.3),
    _variant("luspo", "sequence", 0.0, delta=1.3),
]


def _name(v: dict[str, Any]) -> str:
    extra = ("" if v["use_bias_correction_kl"] else "-nobiaskl") + (
        f"-delta{v['delta']}" if v["delta"] else ""
    )
    return f"{v['loss_type']}-{v['importance_sampling_level']}-beta{v['beta']}{extra}"


def _trl_self(v: dict[str, Any], logps: torch.Tensor, entropy: torch.Tensor, **run: int) -> Any:
    """What ``_compute_loss`` reads of ``self``: one process, no accumulation, unless
    ``run`` says ``processes`` / ``accumulation``."""
    processes, accumulation = run.get("processes", 1), run.get("accumulation", 1)
    args = SimpleNamespace(
        delta=v["delta"],
        use_bias_correction_kl=v["use_bias_correction_kl"],
        sapo_temperature_pos=1.0,
        sapo_temperature_neg=1.05,
        steps_per_generation=accumulation,
    )
    accelerator = SimpleNamespace(
        num_processes=processes, reduce=lambda t, reduction: t, gather=lambda t: t
    )
    return SimpleNamespace(
        loss_type=v["loss_type"],
        beta=v["beta"],
        epsilon_low=v["epsilon_low"],
        epsilon_high=v["epsilon_high"],
        importance_sampling_level=v["importance_sampling_level"],
        args=args,
        accelerator=accelerator,
        current_gradient_accumulation_steps=accumulation,
        max_completion_length=MAX_LEN,
        model=SimpleNamespace(training=True),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, entropy, None),
    )


def _trl(
    v: dict[str, Any], batch: dict[str, torch.Tensor], *, with_old: bool, items: int, **run: int
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """TRL's loss, its gradient w.r.t. the per-token log-probs, and its logged metrics."""
    logps = batch["logps"].clone().requires_grad_(True)
    stub = _trl_self(v, logps, batch["entropy"], **run)
    n = logps.shape[0]
    inputs = {
        "prompt_ids": torch.zeros(n, 2, dtype=torch.long),
        "prompt_mask": torch.ones(n, 2, dtype=torch.long),
        "completion_ids": torch.zeros(n, T, dtype=torch.long),
        "completion_mask": batch["mask"],
        "advantages": batch["advantages"],
        "num_items_in_batch": torch.tensor(items),
        "ref_per_token_logps": batch["ref"],
    }
    if with_old:
        inputs["old_per_token_logps"] = batch["old"]
    loss = GRPOTrainer._compute_loss(stub, None, inputs)
    loss.backward()
    assert logps.grad is not None
    return loss.detach(), logps.grad, {k: vals[-1] for k, vals in stub._metrics["train"].items()}


def _ours(
    v: dict[str, Any], batch: dict[str, torch.Tensor], *, with_old: bool, denominator: float
) -> tuple[PolicyLoss, torch.Tensor]:
    logps = batch["logps"].clone().requires_grad_(True)
    out = policy_loss(
        logps,
        old_logps=batch["old"] if with_old else None,
        advantages=batch["advantages"],
        mask=batch["mask"],
        denominator=denominator,
        ref_logps=batch["ref"],
        entropy=batch["entropy"],
        **v,
    )
    out.loss.backward()
    assert logps.grad is not None
    return out, logps.grad


def _denominator(v: dict[str, Any], mask: torch.Tensor) -> float:
    return loss_denominator(
        loss_type=v["loss_type"],
        num_sequences=mask.shape[0],
        num_tokens=int(mask.sum()),
        max_completion_length=MAX_LEN,
    )


def compare_with_trl(
    v: dict[str, Any], *, dtype: torch.dtype, with_old: bool
) -> tuple[float, float, float]:
    """(loss, gradient, metric) max absolute differences between ours and TRL's."""
    batch = _batch(dtype)
    loss, grad, logged = _trl(v, batch, with_old=with_old, items=int(batch["mask"].sum()))
    ours, our_grad = _ours(v, batch, with_old=with_old, denominator=_denominator(v, batch["mask"]))
    means = metric_means(ours.metrics)
    expected = {k: logged[k] for k in logged if not k.endswith(("_min", "_max"))}
    assert expected.keys() <= means.keys(), f"TRL logs {sorted(expected)}, we {sorted(means)}"
    metric_diff = max((abs(means[k] - expected[k]) for k in expected), default=0.0)
    return (ours.loss - loss).abs().item(), (our_grad - grad).abs().max().item(), metric_diff


@pytest.mark.parametrize("with_old", [True, False], ids=["old", "on-policy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("variant", VARIANTS, ids=_name)
def test_loss_and_gradient_equal_trls(
    variant: dict[str, Any], dtype: torch.dtype, with_old: bool
) -> None:
    loss_diff, grad_diff, metric_diff = compare_with_trl(variant, dtype=dtype, with_old=with_old)
    assert loss_diff <= ATOL and grad_diff <= ATOL and metric_diff <= ATOL


def test_the_inputs_exercise_every_branch() -> None:
    """Clipping binds on both sides and the KL is not trivially 0, so equal losses mean
    something."""
    batch = _batch(torch.float64)
    v = _variant("dapo", "token", 0.04)
    ours, _ = _ours(v, batch, with_old=True, denominator=_denominator(v, batch["mask"]))
    means = metric_means(ours.metrics)
    assert means["clip_ratio/low_mean"] > 0.05 and means["clip_ratio/high_mean"] > 0.05
    assert means["kl"] > 1e-3
    cispo = _variant("cispo", "token", 0.0)
    capped, _ = _ours(cispo, batch, with_old=True, denominator=1.0)
    assert 0 < metric_means(capped.metrics)["cispo_clip_ratio"] < 1


# ---- ranks and micro-batches ([Note: GRPO loss normalization]) -------------------------

RANKS = ((slice(0, 2), slice(2, 3)), (slice(3, 5), slice(5, 6)))
"""2 ranks x 2 micro-batches of unequal sizes over the B = 6 completions."""


def _part(batch: dict[str, torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
    return {k: t[rows] for k, t in batch.items()}


def split_over_ranks(
    v: dict[str, Any], batch: dict[str, torch.Tensor], *, with_old: bool, denominator: float
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The loss, gradient and metrics of ``RANKS`` as the trainer runs them: each
    micro-batch over the global denominator, a rank's sum x dp world size, and FSDP's
    mean over ranks of the ranks' gradients."""
    logps = batch["logps"].clone().requires_grad_(True)
    world, rank_losses, summed = len(RANKS), [], defaultdict(list)
    for micro_batches in RANKS:
        contribution = logps.new_zeros(())
        for rows in micro_batches:
            part = _part({**batch, "logps": logps}, rows)
            out = policy_loss(
                part["logps"],
                old_logps=part["old"] if with_old else None,
                advantages=part["advantages"],
                mask=part["mask"],
                denominator=denominator,
                ref_logps=part["ref"],
                entropy=part["entropy"],
                **v,
            )
            contribution = contribution + out.loss
            for name, pair in out.metrics.items():
                summed[name].append(pair)
        rank_losses.append(world * contribution)
    (sum(rank_losses) / world).backward()
    assert logps.grad is not None
    total = sum(loss.detach() for loss in rank_losses) / world
    return total, logps.grad, metric_means({k: torch.stack(p).sum(0) for k, p in summed.items()})


def split_differences(
    v: dict[str, Any], *, dtype: torch.dtype, with_old: bool
) -> tuple[float, float, float]:
    """(loss, gradient, metric) max absolute differences, split vs whole batch."""
    batch = _batch(dtype)
    denominator = _denominator(v, batch["mask"])  # global counts
    whole, whole_grad = _ours(v, batch, with_old=with_old, denominator=denominator)
    total, grad, means = split_over_ranks(v, batch, with_old=with_old, denominator=denominator)
    whole_means = metric_means(whole.metrics)
    assert means.keys() == whole_means.keys()
    metric_diff = max((abs(means[k] - whole_means[k]) for k in means), default=0.0)
    return (total - whole.loss).abs().item(), (grad - whole_grad).abs().max().item(), metric_diff


@pytest.mark.parametrize("with_old", [True, False], ids=["old", "on-policy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("variant", VARIANTS, ids=_name)
def test_ranks_and_micro_batches_add_up_to_one_process(
    variant: dict[str, Any], dtype: torch.dtype, with_old: bool
) -> None:
    loss_diff, grad_diff, metric_diff = split_differences(variant, dtype=dtype, with_old=with_old)
    assert loss_diff <= ATOL and grad_diff <= ATOL and metric_diff <= ATOL


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "grpo", "dr_grpo", "luspo", "sapo"])
def test_trl_across_processes_and_accumulation_matches_where_the_note_says(
    loss_type: str,
) -> None:
    """TRL on 2 processes x 2 accumulation steps of equal micro-batches (DDP's mean
    over processes) gives our one-process loss: dapo/cispo by their global token count,
    the others because each micro-batch holds the same number of completions."""
    lengths = (7, 5, 3, 1, 6, 0, 2, 7)
    batch, v = _batch(torch.float64, lengths=lengths), _variant(loss_type, "token", 0.04)
    whole, _ = _ours(v, batch, with_old=True, denominator=_denominator(v, batch["mask"]))
    items, processes = int(batch["mask"].sum()), 2
    per_micro_batch = [
        _trl(v, _part(batch, slice(s, s + 2)), with_old=True, items=items, processes=2,
             accumulation=2)[0]
        for s in range(0, len(lengths), 2)
    ]  # fmt: skip
    assert (sum(per_micro_batch) / processes - whole.loss).abs().item() <= ATOL


def test_trl_bnpo_is_per_micro_batch() -> None:
    """The difference the note names: TRL's bnpo averages each micro-batch's own token
    mean, ours is the global token mean."""
    lengths = (7, 7, 1, 1)
    batch, v = _batch(torch.float64, lengths=lengths), _variant("bnpo", "token", 0.0)
    whole, _ = _ours(v, batch, with_old=True, denominator=_denominator(v, batch["mask"]))
    trl = [
        _trl(v, _part(batch, slice(s, s + 2)), with_old=True, items=0, accumulation=2)[0]
        for s in (0, 2)
    ]
    assert (sum(trl) - whole.loss).abs().item() > 1e-3


def test_denominators_and_refusals() -> None:
    counts = {"num_sequences": 6, "num_tokens": 22, "max_completion_length": 9}
    assert loss_denominator(loss_type="grpo", **counts) == 6
    assert loss_denominator(loss_type="luspo", **counts) == 6
    assert loss_denominator(loss_type="dapo", **counts) == 22
    assert loss_denominator(loss_type="bnpo", **{**counts, "num_tokens": 0}) == 1
    assert loss_denominator(loss_type="dr_grpo", **counts) == 54
    with pytest.raises(ValueError, match="max_completion_length"):
        loss_denominator(loss_type="dr_grpo", num_sequences=6, num_tokens=22)
    with pytest.raises(ValueError, match="loss_type = 'ppo'"):
        loss_denominator(loss_type="ppo", **counts)
    batch = _batch(torch.float32)
    common = {"advantages": batch["advantages"], "mask": batch["mask"], "denominator": 6.0}
    with pytest.raises(ValueError, match="ref_logps"):
        policy_loss(batch["logps"], old_logps=None, loss_type="grpo", beta=0.1, **common)
    with pytest.raises(ValueError, match="old_logps of shape"):
        policy_loss(batch["logps"], old_logps=batch["old"][:, :3], loss_type="grpo", **common)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        policy_loss(
            batch["logps"],
            old_logps=None,
            loss_type="grpo",
            importance_sampling_level="segment",
            **common,
        )
