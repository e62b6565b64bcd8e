"""Per-token log-probs of completion tokens equal ``log_softmax(logits / T).gather`` (and
TRL's ``selective_log_softmax``), with the same gradient, in one chunk or many; the
entropy equals TRL's ``entropy_from_logits`` of the scaled logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from trl.trainer.utils import entropy_from_logits, selective_log_softmax

import fsdpkit.loss.logprobs as logprobs
from fsdpkit.loss.logprobs import completion_logps, completion_logps_and_entropy

B, T, V = 3, 5, 37


def _logits(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(B, T, V, generator=g)).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=g)
    upstream = torch.randn(B, T, generator=g, dtype=torch.float64)
    return logits, ids, upstream


def _naive(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    full = F.log_softmax(logits.float() / temperature, dim=-1)
    return full.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("chunk_rows", [1, 4, None], ids=["rows1", "rows4", "one-chunk"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_logps_and_gradient_equal_log_softmax_gather(
    dtype: torch.dtype, temperature: float, chunk_rows: int | None, monkeypatch
) -> None:
    if chunk_rows is not None:
        monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", chunk_rows * V)
    logits, ids, upstream = _logits(dtype)
    ours_in = logits.clone().requires_grad_(True)
    ours = completion_logps(ours_in, ids, temperature=temperature)
    assert ours.dtype == dtype and ours.shape == (B, T)
    naive_in = logits.clone().requires_grad_(True)
    full = F.log_softmax(naive_in / temperature, dim=-1).gather(-1, ids.unsqueeze(-1))
    naive = full.squeeze(-1)
    torch.testing.assert_close(ours, naive, rtol=0, atol=1e-6)
    trl = selective_log_softmax(logits, ids, temperature=temperature)
    torch.testing.assert_close(ours, trl, rtol=0, atol=1e-6)
    (ours * upstream.to(dtype)).sum().backward()
    (naive * upstream.to(dtype)).sum().backward()
    assert ours_in.grad is not None and naive_in.grad is not None
    torch.testing.assert_close(ours_in.grad, naive_in.grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_low_precision_logits_are_scored_in_fp32(temperature: float, monkeypatch) -> None:
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 2 * V)
    logits, ids, upstream = _logits(torch.bfloat16)
    ours_in = logits.clone().requires_grad_(True)
    ours = completion_logps(ours_in, ids, temperature=temperature)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, _naive(logits, ids, temperature), rtol=0, atol=1e-5)
    naive_in = logits.clone().requires_grad_(True)
    (ours * upstream.float()).sum().backward()
    (_naive(naive_in, ids, temperature) * upstream.float()).sum().backward()
    assert ours_in.grad is not None and naive_in.grad is not None
    assert ours_in.grad.dtype == torch.bfloat16
    # both cast an fp32 gradient to bf16: equal up to one bf16 rounding
    torch.testing.assert_close(ours_in.grad, naive_in.grad, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_equals_trls_and_has_no_gradient(temperature: float, monkeypatch) -> None:
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 2 * V)
    logits, ids, _ = _logits(torch.float32)
    logits.requires_grad_(True)
    logps, entropy = completion_logps_and_entropy(logits, ids, temperature=temperature)
    torch.testing.assert_close(logps, _naive(logits, ids, temperature), rtol=0, atol=1e-6)
    expected = entropy_from_logits(logits.detach() / temperature)
    torch.testing.assert_close(entropy, expected, rtol=0, atol=1e-5)
    assert logps.requires_grad and not entropy.requires_grad


def test_refuses_what_it_cannot_score() -> None:
    logits, ids, _ = _logits(torch.float32)
    with pytest.raises(ValueError, match="temperature = 0"):
        completion_logps(logits, ids, temperature=0)
    with pytest.raises(ValueError, match="completion_ids of shape \\(3, 4\\)"):
        completion_logps(logits, ids[:, :4])
