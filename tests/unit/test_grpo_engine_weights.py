"""The engine importance-sampling correction ([Note: engine importance sampling]):
each mode's weights are TRL 1.16's formula, and the loss weighted by them equals TRL's
``_compute_loss`` with ``use_vllm`` and the correction on, for every loss variant
(TRL computes the ratio while generating; its loss multiplies by it)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from test_grpo_loss import ATOL, VARIANTS, _batch, _denominator, _name, _trl_self
from trl.trainer.grpo_trainer import GRPOTrainer

from fsdpkit.loss.grpo import IS_MODES, engine_sampling_weights, metric_means, policy_loss


def _trl_ratio(
    diff: torch.Tensor, mode: str, low: float | None, high: float | None
) -> torch.Tensor:
    """TRL 1.16 GRPOTrainer's ratio (in _generate_and_score_completions), restated."""
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=low, max=high)
    lo = low if low is not None else -math.inf
    hi = high if high is not None else math.inf
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


@pytest.mark.parametrize("bounds", [(None, 3.0), (0.5, 1.5), (0.9, None)])
@pytest.mark.parametrize("mode", IS_MODES)
def test_the_weights_are_trls(mode: str, bounds: tuple[float | None, float | None]) -> None:
    batch = _batch(torch.float64)
    g = torch.Generator().manual_seed(1)
    engine = batch["old"] + 0.2 * torch.randn(batch["old"].shape, generator=g, dtype=torch.float64)
    mask = batch["mask"].double()
    ours = engine_sampling_weights(
        batch["old"], engine, mask, mode=mode, clip_min=bounds[0], clip_max=bounds[1]
    )
    expected = _trl_ratio((batch["old"] - engine) * mask, mode, *bounds)
    torch.testing.assert_close(ours.double(), expected, rtol=1e-6, atol=1e-6)
    assert ours.shape == ((6, 1) if mode.startswith("sequence") else mask.shape)


def _trl_loss(
    v: dict[str, Any], batch: dict[str, torch.Tensor], ratio: torch.Tensor
) -> torch.Tensor:
    logps = batch["logps"].clone().requires_grad_(True)
    stub = _trl_self(v, logps, batch["entropy"])
    stub.use_vllm, stub.vllm_importance_sampling_correction = True, True
    n, t = logps.shape
    inputs = {
        "prompt_ids": torch.zeros(n, 2, dtype=torch.long),
        "prompt_mask": torch.ones(n, 2, dtype=torch.long),
        "completion_ids": torch.zeros(n, t, dtype=torch.long),
        "completion_mask": batch["mask"],
        "advantages": batch["advantages"],
        "num_items_in_batch": torch.tensor(int(batch["mask"].sum())),
        "ref_per_token_logps": batch["ref"],
        "old_per_token_logps": batch["old"],
        "importance_sampling_ratio": ratio,
    }
    return GRPOTrainer._compute_loss(stub, None, inputs).detach()


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
@pytest.mark.parametrize("variant", VARIANTS[:16], ids=_name)
def test_the_weighted_loss_is_trls(variant: dict[str, Any], mode: str) -> None:
    batch = _batch(torch.float64)
    g = torch.Generator().manual_seed(2)
    engine = batch["old"] + 0.05 * torch.randn(batch["old"].shape, generator=g, dtype=torch.float64)
    weights = engine_sampling_weights(
        batch["old"], engine, batch["mask"].double(), mode=mode, clip_min=None, clip_max=3.0
    ).double()
    ours = policy_loss(
        batch["logps"],
        old_logps=batch["old"],
        advantages=batch["advantages"],
        mask=batch["mask"],
        denominator=_denominator(variant, batch["mask"]),
        ref_logps=batch["ref"],
        entropy=batch["entropy"],
        sampling_weights=weights,
        **variant,
    )
    assert abs(float(ours.loss) - float(_trl_loss(variant, batch, weights))) <= ATOL
    assert 0.5 < metric_means(ours.metrics)["engine_is_ratio"] < 2.0  # logged, near 1
