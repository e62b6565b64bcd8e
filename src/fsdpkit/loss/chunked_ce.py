"""Cross-entropy of a linear output head, computed in token chunks.

``chunked_linear_cross_entropy(hidden, weight, bias, targets, chunk_tokens=...)`` equals
``F.cross_entropy((hidden @ weight.T + bias).float(), targets, reduction="sum",
ignore_index=...)`` and its gradients, without ever holding the logits of more than
``chunk_tokens`` tokens.

[Note: chunked cross-entropy]
The full path keeps, per micro-batch of N tokens and vocabulary V, the logits (N*V in
the compute dtype), their fp32 copy and fp32 log-probabilities, and in backward the
fp32 logits gradient and its cast: 23.5 GiB for 2 x 8192 tokens of a 128k vocabulary.
Here, per chunk of c tokens:

- forward: logits_c = hidden_c @ W.T in the compute dtype (as the head would), their
  fp32 copy, log-sum-exp per token in fp32 computed in place in that copy; the
  chunk's losses are summed and every chunk tensor dies. Saved for backward: the
  per-token log-sum-exp (N fp32) and the flattened targets; hidden and W are alive
  anyway (the head's matmul saves them too).
- backward: the chunk's logits are recomputed (the trade-off: one more head matmul,
  2*N*V*d FLOPs per micro-batch), turned in place into softmax - one_hot (fp32),
  scaled by the incoming gradient, cast to the compute dtype as autograd's cast back
  would, then grad_hidden_c = g @ W and grad_W += g.T @ hidden_c (accumulated in the
  compute dtype, as autograd accumulates the chunks' grads of a shared weight).

[Note: chunked cross-entropy peak]
The head's weight grad is the first chunk's product (never beside that chunk's fp32
buffer); after it, a chunk's logits in the compute dtype and in fp32 coexist with the
weight grad, where the full path holds only the N*V*e logits gradient beside it. In
low precision, chunks after the first in backward are therefore at most N/3 tokens
(c*(2+4) <= N*2), so at no point of the loss does the chunked path hold more than the
full one (but for the saved log-sum-exp and targets, 12 bytes per token):
``train.chunked_loss = auto`` needs no planning. In fp32 every later chunk
is at most N/2 already.

[Note: compiling the chunk]
With ``compiled`` (``train.compile`` in a low-precision run), each chunk's forward
(logits, log-sum-exp, picked logit) and gradient (recomputed logits, softmax - one-hot,
scale, cast) run as inductor graphs; the two gradient matmuls stay eager (they write
into existing buffers). ``python bench/loss_compile.py`` (one chunk, 1024 tokens x
32768 x 256, 1 CPU thread): bf16 1.27x faster compiled (716 -> 565 ms, control 1.00x),
fp32 0.98x: the cast-free fp32 path has nothing left to fuse, so fp32 runs stay eager.
The planner plans the eager kernels (an upper bound, as for compiled blocks).

[Note: vocabulary-parallel cross-entropy]
Under tensor parallelism the head is split by vocabulary rows over the tp ranks
(fsdpkit.sharding.tensor.plans): each rank holds rows [offset, offset + V / tp) and the
whole hidden states. Per chunk it computes only its logits (c x V / tp), their
log-sum-exp and the target's logit where the target is one of its rows (else 0); one
all-gather of those two c-vectors over tp gives every rank the chunk's global
log-sum-exp (log-sum-exp of the ranks' values) and target logit (their sum), so the
loss is the same number on every tp rank. In backward each rank turns its own
logits into its columns of softmax - one-hot, its grad of the head rows is local,
and its grad of the hidden states is a partial sum over its vocabulary: one
all-reduce of the (N, d) hidden-state grad after the last chunk completes it
(Megatron's vocab-parallel cross-entropy, computed in chunks). The head's matmuls and
its chunk buffers are divided by tp; nothing of vocabulary size crosses the wire.

[Note: the head's gradient under fake tensors]
A tied head's weight is the embedding's: its AccumulateGrad node waits for two
gradients, the loss's (first in backward) and the embedding's (last), and autograd's
InputBuffer holds the loss's until the embedding's arrives. A real run's buffer adds
the second into the first in place (torch/csrc/autograd/input_buffer.cpp,
``accumulate``: in place unless a tensor subclass or another reference is involved);
AccumulateGrad (functions/accumulate_grad.h) then steals the sum as ``.grad`` where
there is none (a micro-batch after the optimizer step) or adds it into ``.grad`` in
place (a later micro-batch of ``last`` accumulation: FSDP2 leaves the unsharded grad
on the parameter, [Note: accumulating in place] in fsdpkit.planner.replay.gradlife). Fake
tensors are subclasses, so a trace's buffer sums out of place, one V*d more than the
real run. With ``grad_into_weight`` the loss does what the real run's memory does:
no ``.grad`` yet, its gradient becomes ``.grad`` at once (the embedding's is added
into it in place, as into the buffer); ``.grad`` there already, its gradient stays
alive beside it through the rest of the backward, as in the buffer, and a
post-accumulate-grad hook adds it in place once the embedding's is in. Adding it into
``.grad`` at once in that case too left the V*d gradient out of every block backward
of the last micro-batch: bench/plan_accuracy.py's "ACC A accum=2 +AC" and "...
selective" traced 3.2% and 2.2% under their measured peaks, now -0.03% and -0.02%.
An untied head's AccumulateGrad runs right after the loss's backward (with no
gradient: its hook adds at once), as it would with the gradient returned.

Numerics match the full path: logits in the compute dtype, softmax and loss in fp32.
Ignored targets contribute no loss and no gradient. The head's weight is used as
given: under FSDP2 the caller runs this while the root unit's parameters are
unsharded (fsdpkit.loss.head), so the head is all-gathered once per micro-batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows of a head split by vocabulary over ``group`` ([Note:
    vocabulary-parallel cross-entropy]): global rows [offset, offset + local rows)."""

    group: dist.ProcessGroup
    offset: int


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())


class _ChunkedLinearCE(torch.autograd.Function):
    """Sum over tokens of -log softmax(h @ W.T + b)[target]; see the module note."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk: int,
        ignore_index: int,
        grad_into_weight: bool,
        compiled: bool,
        shard: VocabShard | None,
    ) -> torch.Tensor:
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        forward = _compiled(_chunk_forward) if compiled else _chunk_forward
        offset = shard.offset if shard is not None else 0
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            tgt = targets[rows]
            lse[rows], picked = forward(hidden[rows], weight, bias, tgt, offset)
            if shard is not None:
                lse[rows], picked = _across_vocab(lse[rows], picked, group=shard.group)
            total += torch.where(tgt != ignore_index, lse[rows] - picked, 0.0).sum()
        ctx.save_for_backward(hidden, weight, bias, targets, lse)  # type: ignore[arg-type]
        ctx.chunk, ctx.ignore_index = chunk, ignore_index  # type: ignore[attr-defined]
        ctx.grad_into_weight = grad_into_weight  # type: ignore[attr-defined]
        ctx.compiled, ctx.shard = compiled, shard  # type: ignore[attr-defined]
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w: torch.Tensor | None = None  # made by the first chunk: never beside its fp32
        grad_b = torch.zeros_like(bias) if need_b else None
        cast = weight.dtype != torch.float32
        chunk_grad = _compiled(_chunk_grad) if ctx.compiled else _chunk_grad
        offset = ctx.shard.offset if ctx.shard is not None else 0
        for rows in backward_chunks(hidden.shape[0], ctx.chunk, cast=cast):
            g = chunk_grad(
                hidden[rows], weight, bias, targets[rows], lse[rows], grad_total,
                ctx.ignore_index, offset,
            )  # fmt: skip
            if grad_h is not None:
                torch.mm(g, weight, out=grad_h[rows])
            if need_w and grad_w is None:
                grad_w = g.t() @ hidden[rows]
            elif grad_w is not None:
                grad_w.addmm_(g.t(), hidden[rows])
            if grad_b is not None:
                grad_b += g.sum(0)
            del g
        if grad_h is not None and ctx.shard is not None:  # each rank's vocabulary's part
            dist.all_reduce(grad_h, group=ctx.shard.group)
        if grad_w is not None and ctx.grad_into_weight and weight.is_leaf:
            _into_weight_grad(weight, grad_w)
            grad_w = None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def _into_weight_grad(weight: torch.Tensor, grad_w: torch.Tensor) -> None:
    """``grad_w`` summed into ``weight.grad`` when and where a real run's autograd sums
    it ([Note: the head's gradient under fake tensors])."""
    if weight.grad is None:
        weight.grad = grad_w
        return

    def add(w: torch.Tensor) -> None:
        assert w.grad is not None  # the accumulated grad this backward started from
        w.grad.add_(grad_w)
        handle.remove()

    handle = weight.register_post_accumulate_grad_hook(add)


@functools.cache
def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled by inductor, once per process ([Note: compiling the chunk])."""
    return torch.compile(fn, fullgraph=True)


def _local_targets(
    tgt: torch.Tensor, *, offset: int, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(column of each target in this rank's ``rows`` vocabulary rows, clamped into
    range; whether the target is one of them). An ignored target is never in range."""
    local = tgt - offset
    return local.clamp(0, rows - 1), (local >= 0) & (local < rows)


def _chunk_forward(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tgt: torch.Tensor,
    offset: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-sum-exp per token, the target's logit per token: 0 where the target is not
    in this rank's rows) over the local vocabulary; the logits die on return."""
    logits = _logits(h, weight, bias).float()  # a fresh fp32 buffer
    col, hit = _local_targets(tgt, offset=offset, rows=weight.shape[0])
    picked = torch.where(hit, logits.gather(1, col.unsqueeze(1)).squeeze(1), 0.0)
    return _logsumexp_(logits), picked


def _across_vocab(
    lse: torch.Tensor, picked: torch.Tensor, *, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ranks' local log-sum-exps and target logits combined: one all-gather of the
    two vectors ([Note: vocabulary-parallel cross-entropy])."""
    both = torch.stack([lse, picked])
    ranks = dist.get_world_size(group)
    gathered = both.new_empty((ranks * 2, both.shape[1]))  # concatenated rank by rank
    dist.all_gather_single(gathered, both, group=group)
    gathered = gathered.view(ranks, 2, -1)
    return torch.logsumexp(gathered[:, 0], dim=0), gathered[:, 1].sum(dim=0)


def backward_chunks(n: int, chunk: int, *, cast: bool) -> list[slice]:
    """Rows of each backward chunk ([Note: chunked cross-entropy peak]); the planner
    reads the first two sizes from here."""
    first = min(chunk, n)
    later = min(chunk, max(1, n // 3)) if cast else chunk
    return [slice(0, first)] + [slice(i, min(i + later, n)) for i in range(first, n, later)]


def _logsumexp_(x: torch.Tensor) -> torch.Tensor:
    """Row-wise log-sum-exp of finite ``x``, overwriting ``x`` (torch.logsumexp would
    allocate a second chunk-sized buffer inside its kernel, unseen by tracers)."""
    top = x.amax(dim=-1, keepdim=True)
    return x.sub_(top).exp_().sum(dim=-1).log_().add_(top.squeeze(-1))


def _chunk_grad(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tgt: torch.Tensor,
    lse: torch.Tensor,
    grad_total: torch.Tensor,
    ignore_index: int,
    offset: int,
) -> torch.Tensor:
    """d loss / d logits of one chunk over the local vocabulary, in the compute dtype:
    (softmax - one_hot) times the incoming gradient, zero on ignored rows."""
    g = _logits(h, weight, bias).float()  # a fresh fp32 buffer (or the logits in fp32)
    g.sub_(lse.unsqueeze(1)).exp_()
    col, hit = _local_targets(tgt, offset=offset, rows=weight.shape[0])
    g[torch.arange(g.shape[0], device=g.device), col] -= hit.to(g.dtype)
    g.mul_(torch.where(tgt != ignore_index, grad_total, 0.0).unsqueeze(1))
    return g.to(weight.dtype)


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    chunk_tokens: int,
    ignore_index: int = -100,
    grad_into_weight: bool = False,
    compiled: bool = False,
    shard: VocabShard | None = None,
) -> torch.Tensor:
    """Sum of the fp32 cross-entropy of every token whose target is not
    ``ignore_index``: ``hidden`` (N, d) or (..., d), ``weight`` (V, d), ``targets``
    with ``hidden``'s leading shape. Divide by the count (mean) or a normalizer.

    ``grad_into_weight``: sum the weight's gradient into ``weight.grad`` (a leaf)
    itself instead of returning it to autograd, when and where a real run's autograd
    would ([Note: the head's gradient under fake tensors]): the traced planner's
    setting, for fake tensors, which autograd sums out of place. ``compiled``:
    each chunk's kernels run compiled ([Note: compiling the chunk]). ``shard``:
    ``weight`` (and ``bias``) are this rank's rows of a head split by vocabulary, the
    targets global ids ([Note: vocabulary-parallel cross-entropy]); collective over
    its group."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    if flat.dtype != weight.dtype:  # what the head's matmul needs (autograd casts back)
        flat = flat.to(weight.dtype)
    out = _ChunkedLinearCE.apply(
        flat, weight, bias, targets.reshape(-1), chunk_tokens, ignore_index, grad_into_weight,
        compiled, shard,
    )  # fmt: skip
    return out  # type: ignore[no-any-return]
