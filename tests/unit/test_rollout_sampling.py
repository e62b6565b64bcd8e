"""The rollout's draw: top-k / top-p keep what transformers' warpers keep, each row draws
from its own stream whatever batch it is in, and the draws follow softmax(z / T)."""

from __future__ import annotations

import pytest
import torch

from fsdpkit.rollout.sampling import Sampling, completion_seed, draw, filtered, generators


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (3, 1.0), (0, 0.8), (5, 0.6), (1, 1.0)])
def test_filtered_keeps_what_transformers_warpers_keep(top_k: int, top_p: float) -> None:
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    ours = filtered(logits, top_k=top_k, top_p=top_p)
    theirs = logits.clone()
    if top_k:
        theirs = TopKLogitsWarper(top_k)(None, theirs)
    if top_p < 1.0:
        theirs = TopPLogitsWarper(top_p)(None, theirs)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))


def test_a_row_draws_the_same_tokens_in_any_batch() -> None:
    """[Note: world-size-independent samples]: row i's tokens depend on its seed alone."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    seeds = [completion_seed(seed=0, step=3, position=p, index=0) for p in range(4)]
    sampling = Sampling(max_new_tokens=1, top_k=20, top_p=0.9)
    together, logps = draw(
        logits, sampling=sampling, streams=generators(seeds, device=logits.device)
    )
    for i in range(4):
        alone, lp = draw(
            logits[i : i + 1],
            sampling=sampling,
            streams=generators([seeds[i]], device=logits.device),
        )
        assert int(alone) == int(together[i])
        assert float(lp) == pytest.approx(float(logps[i]), abs=1e-6)


def test_draws_follow_the_tempered_softmax_and_logps_are_its_log() -> None:
    z = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    temperature = 0.7
    n = 20_000
    streams = generators(range(n), device=z.device)
    scaled = (z / temperature).expand(n, -1)
    tokens, logps = draw(scaled, sampling=Sampling(max_new_tokens=1), streams=streams)
    freq = torch.bincount(tokens, minlength=5).double() / n
    want = torch.softmax(z[0] / temperature, dim=-1).double()
    assert (freq - want).abs().max() < 0.015
    assert torch.allclose(logps, torch.log_softmax(scaled, -1).gather(1, tokens[:, None])[:, 0])


def test_top_k_one_is_greedy() -> None:
    logits = torch.randn(8, 30, generator=torch.Generator().manual_seed(3))
    tokens, _ = draw(
        logits,
        sampling=Sampling(max_new_tokens=1, top_k=1),
        streams=generators(range(8), device=logits.device),
    )
    assert torch.equal(tokens, logits.argmax(-1))


def test_completion_seeds_differ_per_step_prompt_and_index_and_are_stable() -> None:
    keys = [(s, p, i) for s in range(3) for p in range(3) for i in range(3)]
    seeds = {completion_seed(seed=7, step=s, position=p, index=i) for s, p, i in keys}
    assert len(seeds) == len(keys)
    assert completion_seed(seed=7, step=1, position=2, index=0) == completion_seed(
        seed=7, step=1, position=2, index=0
    )
    assert all(0 <= s < 2**63 for s in seeds)
