"""Per-token log-probabilities (and entropies) of sampled completion tokens under
``logits / temperature``, in fp32, without a full log-softmax copy of the logits.

[Note: selective log-softmax]
A policy-gradient loss needs, per completion token, ``log softmax(z)[y]`` with ``z =
logits / temperature`` (TRL divides by the sampling temperature so the trainer scores
the distribution the tokens were drawn from). ``log_softmax(z).gather(y)`` under
autograd keeps, per micro-batch of N tokens and vocabulary V, the scaled copy of the
logits, their fp32 copy and the fp32 log-softmax: up to three N*V tensors beside the
logits themselves. Here ``log p_y = z_y - logsumexp(z)`` is computed in row chunks of at
most ``CHUNK_ELEMENTS`` values: a chunk's fp32 (scaled) copy is the only N*V-shaped
temporary and dies with the chunk. Saved for backward: the logits (alive anyway), the
token ids and the per-token log-sum-exp (N values). The backward recomputes each chunk's
softmax and writes ``g * (one_hot(y) - softmax(z)) / temperature`` in the logits' dtype,
as autograd's cast back would.

The entropy ``H = -sum p log p`` (``log p = z - logsumexp(z)``; ``logsumexp(z) - sum p
z`` cancels in fp32 for peaked logits) comes from the same chunk in the same pass, for
the metric TRL logs; it carries no gradient (an entropy bonus would need one and is not
offered).
"""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx

CHUNK_ELEMENTS = 1 << 24
"""Logit values (64 MiB in fp32) per chunk: rows = max(1, CHUNK_ELEMENTS // vocab)."""


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for every float type below it, fp64 kept (tests compare in fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _scaled(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    """A chunk of logits in the accumulate dtype, divided by the temperature."""
    z = chunk.to(_accumulate_dtype(chunk.dtype))
    return z / temperature if temperature != 1.0 else z


class _SelectiveLogSoftmax(torch.autograd.Function):
    """(log softmax(logits / T)[ids], entropy) per row; see [Note: selective log-softmax]."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        logits: torch.Tensor,
        ids: torch.Tensor,
        temperature: float,
        rows: int,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        flat, index = logits.reshape(-1, logits.shape[-1]), ids.reshape(-1, 1)
        dtype = _accumulate_dtype(logits.dtype)
        logps = flat.new_empty(flat.shape[0], dtype=dtype)
        lse = flat.new_empty(flat.shape[0], dtype=dtype)
        entropy = flat.new_zeros(flat.shape[0] if with_entropy else 0, dtype=dtype)
        for start in range(0, flat.shape[0], rows):
            end = start + rows
            z = _scaled(flat[start:end], temperature)
            lse[start:end] = torch.logsumexp(z, dim=-1)
            logps[start:end] = z.gather(1, index[start:end]).squeeze(1) - lse[start:end]
            if with_entropy:
                logp = z - lse[start:end, None]
                entropy[start:end] = -(torch.exp(logp) * logp).sum(-1)
        ctx.save_for_backward(logits, ids, lse)
        ctx.temperature, ctx.rows = temperature, rows  # type: ignore[attr-defined]
        ctx.mark_non_differentiable(entropy)
        return logps.reshape(ids.shape), entropy.reshape(ids.shape if with_entropy else (0,))

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: FunctionCtx, grad_logps: torch.Tensor, _grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor, None, None, None, None]:
        logits, ids, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        temperature, rows = ctx.temperature, ctx.rows  # type: ignore[attr-defined]
        flat, index = logits.reshape(-1, logits.shape[-1]), ids.reshape(-1, 1)
        g = grad_logps.reshape(-1, 1).to(lse.dtype)
        grad = torch.empty_like(flat)
        for start in range(0, flat.shape[0], rows):
            end = start + rows
            p = torch.exp(_scaled(flat[start:end], temperature) - lse[start:end, None])
            p.mul_(-g[start:end]).scatter_add_(1, index[start:end], g[start:end])
            grad[start:end] = p / temperature if temperature != 1.0 else p
        return grad.reshape(logits.shape), None, None, None, None


def _check(logits: torch.Tensor, completion_ids: torch.Tensor, temperature: float) -> int:
    """Rows per chunk, after checking the arguments."""
    if temperature <= 0:
        raise ValueError(f"temperature = {temperature} must be positive")
    if logits.dim() != completion_ids.dim() + 1 or logits.shape[:-1] != completion_ids.shape:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} do not score completion_ids of shape "
            f"{tuple(completion_ids.shape)}: pass the logits at the completion positions "
            "(batch, completion length, vocab), shifted so position t predicts token t"
        )
    return max(1, CHUNK_ELEMENTS // logits.shape[-1])


def completion_logps(
    logits: torch.Tensor, completion_ids: torch.Tensor, *, temperature: float = 1.0
) -> torch.Tensor:
    """(B, T) ``log softmax(logits / temperature)[completion_ids]`` in fp32 (fp64 logits
    stay fp64), differentiable w.r.t. ``logits`` ([Note: selective log-softmax])."""
    rows = _check(logits, completion_ids, temperature)
    ids = completion_ids.long()
    logps, _ = _SelectiveLogSoftmax.apply(logits, ids, temperature, rows, False)
    return logps


def completion_logps_and_entropy(
    logits: torch.Tensor, completion_ids: torch.Tensor, *, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``completion_logps`` and, from the same pass, each position's entropy of
    ``softmax(logits / temperature)`` (no gradient; a metric)."""
    rows = _check(logits, completion_ids, temperature)
    ids = completion_ids.long()
    logps, entropy = _SelectiveLogSoftmax.apply(logits, ids, temperature, rows, True)
    return logps, entropy.detach()
