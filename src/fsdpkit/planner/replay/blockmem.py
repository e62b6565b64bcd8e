"""Tensor lifetimes inside one decoder block, as alloc/free events (the loss head's:
fsdpkit.planner.replay.headmem).

[Note: block event model]
The memory of a block's forward and backward is written out op by op for the
built-in Llama block (fsdpkit.models.llama): each op allocates its output, saved
tensors stay until the backward node that saved them has run, everything else dies
at its last use, and gradients flowing into a tensor used twice are accumulated in
place (autograd's InputBuffer steals a sole-owner buffer). An event is
(category, +/- bytes); the analytic planner replays them into its ledger, so the
peak inside a block (and what is live at that moment) falls out of the sum rather
than a fudge factor. The saved set per block is

    4*N*d*4 + 6*N*d*e + 4*N*f*e + 8*N + 4*N*heads   (+ 2*d*4 when e != 4)

bytes for N tokens in compute dtype e: fp32 norm internals (input, normalized), the
q/k/v/output of attention (k and v after GQA repeat), and the four SwiGLU tensors.
Each number here was checked against the CPU allocator on real runs (bench/).
Context parallelism keeps this saved set at m tokens per rank; its exchanges are
Ulysses's all-to-alls here, or ring attention's buffers ([Note: ring attention
memory] in fsdpkit.planner.replay.ringmem) when ``Sizes.ring``.

[Note: selective block memory]
Under ``activations.mode = "selective"`` ([Note: selective checkpointing] in
fsdpkit.sharding.activations) a block keeps, besides its input (held by the
checkpoint, as under full checkpointing), the outputs its policy saves. The block's
seven matmuls run q, k, v, o, gate, up, down, so the 1st, 3rd, 5th and 7th are
saved — q_proj's (before RoPE), v_proj's (before the GQA repeat), gate_proj's and
down_proj's — and attention's output and fp32 log-sum-exp:

    2*N*h*hd*e + N*kv*hd*e + 4*N*h + N*f*e + N*d*e   bytes   (``selective_saved``)

In backward the recompute takes those from storage instead of running the ops:
q and v die once RoPE and the repeat have consumed them, gate and attention's
outputs become autograd's saved tensors as under full checkpointing, and
down_proj's output, never asked for again (the recompute stops early, before
down_proj), lives until the block's backward ends and the checkpoint frame dies.
Under tp / cp the block's collectives are saved too ([Note: selective checkpointing
of exchanges]).

[Note: selective checkpointing of exchanges]
The selective policy also saves the outputs of the functional collectives
(``COLLECTIVE_OPS`` in fsdpkit.sharding.activations), and every exchange inside a
tensor- or context-parallel block is one of them, read from torch 2.13 and fsdpkit:

- sequence parallelism's gathers (``GatherSequence``: DTensor Shard(1) -> Replicate,
  ``funcol.all_gather_single``): ``all_gather_into_tensor`` gathers along dim 0, then
  ``_maybe_view_chunk_cat`` moves the chunks to the sequence dim — a copy (what the
  projections read) unless the micro-batch is 1, where it is a view of the saved
  output; either way m x d x e bytes stay per gather, two per block;
- the row-parallel o / down outputs (``RowwiseParallel``): Partial -> Shard(1) is
  ``reduce_scatter_tensor`` after a chunk-cat to dim 0, its n-token output saved
  rather than dying at the residual add; without sequence parallelism Partial ->
  Replicate is ``all_reduce``, out of place (its own copy), saved the same way;
- Ulysses's all-to-alls (``all_to_all_single_autograd``, whose autograd kernel runs
  ``_c10d_functional.all_to_all_single`` under the policy's mode): the received q,
  k, v (k / v at the heads ``Sizes.nxe`` sends: repeated by ``kv_repeat`` when they
  do not divide by cp) and the received output; the layout copies after them
  (permute-reshape) are recomputed; in transformers' attention also the whole
  sequence's int64 position ids, gathered per block for the document mask
  (``whole_mask``; ``Sizes.block_positions``): 8 x cp x m bytes.

So per block (``exchange_saved``) 2 x m x d x e + 2 x n x d x e under tp, and
m x (2 heads + 2 kv') x hd x e (+ the positions) under Ulysses. Ring attention's
gathers and permutes run inside torch's ring SDPA on DTensors, one attention op to
the policy (saved as attention), so none is added. In backward the recompute takes
each saved output where forward made it, and it dies once read (as q and v do) —
except down_proj's reduced output: the recompute stops before down_proj, so it stays
with down_proj's output to the end of the block's backward
(``selective_backward_end``). With a micro-batch of 1 a gathered input is a view of
the saved output, so forward holds m x d x e less than modeled while it lives (the
safe side). Measured (bench/plan_accuracy.py, the "MP ... selective" rows at world
4): -0.04% to -0.22% of the real peak; without these bytes -9% (dp2 x cp2) to -21%
(tp2 x cp2).
"""

from __future__ import annotations

from fsdpkit.planner.replay import blockexchange as xc
from fsdpkit.planner.replay.blocksizes import (
    ACT,
    GRAD,
    LOGITS,
    TEMP,
    XCHG,
    Event,
    ForWeights,
    Sizes,
)
from fsdpkit.planner.replay.ringmem import ring_backward, ring_forward

__all__ = ["ACT", "GRAD", "LOGITS", "TEMP", "XCHG", "Event", "Sizes"]


def saved_per_block(s: Sizes) -> int:
    """Bytes a block keeps for backward without checkpointing, its input included
    when it is saved (fp32) — see [Note: block event model]."""
    if s.cast and s.norm_casts_first:  # xf and the cast xn; no fp32 weight
        norms = 2 * (s.nd4 + s.nde + s.nme + 4 * s.n)
    else:
        norms = 2 * (2 * s.nd4 + s.nme + 4 * s.n + (4 * s.d if s.cast else 0))
    attn = s.nqe + 2 * s.nse + s.nqe + s.nh4 + (s.nqe if s.cp > 1 else 0)
    return norms + attn + 4 * s.nfe


def selective_saved(s: Sizes) -> int:
    """Bytes selective checkpointing keeps per block beyond its input ([Note:
    selective block memory]), the collectives' outputs included."""
    return 2 * s.nqe + s.nke + s.nh4 + s.nfe + s.nme + xc.exchange_saved(s)


def block_matmuls(*, d: int, f: int, heads: int, kv_heads: int, head_dim: int) -> list[int]:
    """Weight elements of the built-in Llama block's matmuls in forward order: q, k,
    v, o, gate, up, down (the order the selective policy counts them in)."""
    q, kv = d * heads * head_dim, d * kv_heads * head_dim
    return [q, kv, kv, q, d * f, d * f, d * f]


def _saved(size: int) -> list[Event]:
    """A temporary that the selective policy saves: it moves to the activations."""
    return [(ACT, size), (TEMP, -size)]


def norm_forward(s: Sizes, *, keep: bool) -> list[Event]:
    """RMSNorm in fp32: xf=x.float(), x*rsqrt(mean(x^2)+eps), weight*xn, .to(e)."""
    if not keep:
        return _norm_forward_unsaved(s)
    ev: list[Event] = [(ACT, s.nd4)] if s.cast else []
    ev += [(TEMP, s.nd4), (TEMP, 4 * s.n), (TEMP, -s.nd4), (TEMP, 4 * s.n), (TEMP, -4 * s.n)]
    if s.cast and s.norm_casts_first:  # xn (dies at return), xn.to(e) (saved), weight * it
        cast = ACT if s.norm_grads else TEMP
        ev += [(ACT, 4 * s.n), (TEMP, -4 * s.n), (TEMP, s.nd4), (cast, s.nde), (ACT, s.nde)]
        return ev + [(TEMP, -s.nd4)] + ([] if s.norm_grads else [(TEMP, -s.nde)])
    if not s.norm_grads:  # xn is used by weight * xn only: it dies there
        ev += [(ACT, 4 * s.n), (TEMP, -4 * s.n), (TEMP, s.nd4)]
        ev += [(TEMP, s.nd4), (ACT, s.nde), (TEMP, -s.nd4)] if s.cast else [(ACT, s.nd4)]
        return [*ev, (TEMP, -s.nd4)]
    ev += [(ACT, 4 * s.n), (TEMP, -4 * s.n), (ACT, s.nd4)]
    ev += [(ACT, 4 * s.d)] if s.cast else []
    return ev + ([(TEMP, s.nd4), (ACT, s.nde), (TEMP, -s.nd4)] if s.cast else [(ACT, s.nd4)])


def _norm_forward_unsaved(s: Sizes) -> list[Event]:
    """The same under checkpointing: nothing is saved, each tensor dies with its name."""
    ev: list[Event] = [(TEMP, s.nd4)] if s.cast else []
    ev += [(TEMP, s.nd4), (TEMP, -s.nd4), (TEMP, s.nd4)]  # x^2 (dies at mean), xn
    ev += [(TEMP, -s.nd4)] if s.cast else []  # xf rebound to xn
    if s.cast and s.norm_casts_first:  # weight * xn.to(e): the cast dies with the product
        return [*ev, (TEMP, s.nde), (ACT, s.nde), (TEMP, -s.nde), (TEMP, -s.nd4)]
    ev += [(TEMP, s.nd4)]  # weight * xn
    if s.cast:
        ev += [(ACT, s.nde), (TEMP, -s.nd4)]
    else:
        ev += [(ACT, s.nd4), (TEMP, -s.nd4)]
    return [*ev, (TEMP, -s.nd4)]  # xn dies at return


def _rope_forward(size: int) -> list[Event]:
    """(x*cos + rotate_half(x)*sin): returns the rotated copy; x dies afterwards."""
    return [
        (TEMP, size), (TEMP, size // 2), (TEMP, size), (TEMP, -(size // 2)),
        (TEMP, size), (TEMP, -size), (ACT, size), (TEMP, -2 * size), (TEMP, -size),
    ]  # fmt: skip


def _attn_forward(s: Sizes, *, keep: bool, selective: bool = False) -> list[Event]:
    rep = s.rep  # 1 with sdpa's own grouped-query attention (Sizes.gqa)
    ev: list[Event] = [(TEMP, s.nqe), (TEMP, s.nke), (TEMP, s.nke)]
    # q, k = rope(q), rope(k): the raw q lives until both are computed
    ev += _rope_forward(s.nqe)[:-1] + _rope_forward(s.nke)
    ev += _saved(s.nqe) if selective else [(TEMP, -s.nqe)]
    ev += xc.kept(xc.positions(s), selective)  # the mask's gathered positions (transformers)
    sent = s.nqe + 2 * s.nxe  # q, k, v: sequence for heads
    ev += xc.exchange(s, s.nqe + 2 * s.nke, saved=sent, selective=selective)
    if rep > 1:  # repeat_interleave copies k and v to every query head
        ev += [(ACT, s.nqe), (ACT, -s.nke), (ACT, s.nqe)]
        ev += _saved(s.nke) if selective else [(TEMP, -s.nke)]
    else:  # v itself is saved by attention
        ev += [(TEMP, -s.nke), (ACT, s.nke)]
    # attention output + logsumexp (ring: its buffers on the way, fsdpkit.planner.replay.ringmem)
    ev += ring_forward(s) if s.ring and s.cp > 1 else [(ACT, s.nqe + s.nh4)]
    # the output exchanged back (ring: copied): o_proj's input (saved when kept)
    back = xc.exchange(s, s.nqe, ring_too=True, saved=s.nqe, selective=selective)
    ev += [(ACT, s.nqe)] if s.cp > 1 and keep else back
    if selective:  # rotated q and k, the repeated copies die; v, output, lse stay
        ev += [(ACT, -(3 * s.nqe if rep > 1 else s.nqe + s.nke))]
    elif not keep:
        ev += [(ACT, -(2 * s.nqe + 2 * s.nse + s.nh4))]
    o_proj = xc.row_add(s, selective=selective)
    return [*ev, (TEMP, s.nme), *o_proj, (TEMP, -s.nme)]  # o_proj, residual -> x1


def _mlp_forward(s: Sizes, *, keep: bool, selective: bool = False) -> list[Event]:
    """gate, silu, up, product (all saved), down_proj, residual add -> block output."""
    if keep:
        return [(ACT, 4 * s.nfe), (TEMP, s.nme), *xc.row_add(s), (TEMP, -s.nme)]
    f = s.nfe  # unsaved: gate dies into silu, silu and up into the product
    gate = _saved(f) if selective else [(TEMP, -f)]
    down = _saved(s.nme) if selective else [(TEMP, -s.nme)]
    return [
        (TEMP, f), (TEMP, f), *gate, (TEMP, f), (TEMP, f), (TEMP, -2 * f),
        (TEMP, s.nme), (TEMP, -f), *xc.row_add(s, selective=selective), *down,
    ]  # fmt: skip


def block_forward(
    s: Sizes, *, keep: bool, selective: bool = False, fresh: bool = False
) -> list[Event]:
    """Forward of one block whose input (N*d*e, counted by the caller) is live.

    ``keep`` = autograd saves for backward (no checkpointing); ``selective`` (with
    ``keep`` false) = the selective policy's outputs stay ([Note: selective block
    memory]). Ends with the output live; the input is freed unless something saved
    it (fp32 alias, or the checkpoint). ``fresh`` (with ``keep``): the block's input
    needs no gradient (the first trainable block after a frozen embedding), so its
    first norm saves only what its weight's gradient needs (nothing when frozen:
    LoRA) besides its output, which the projections save, and in fp32 nothing keeps
    the input.
    """
    cat, y = xc.projection_input(s)
    first = _fresh_norm_forward(s) if fresh else norm_forward(s, keep=keep)
    ev = first + xc.gather(s, selective=selective)
    ev += _attn_forward(s, keep=keep, selective=selective)
    if not keep:
        ev += [(cat, -y)]  # norm1 output: only q/k/v projections used it
    ev += norm_forward(s, keep=keep) + xc.gather(s, selective=selective)
    ev += _mlp_forward(s, keep=keep, selective=selective)
    if keep and s.frozen_linears:  # the projections' inputs and down_proj's: not saved
        ev += [(cat, -y), (cat, -y), (ACT, -s.nfe)]
    if keep and s.adapters:
        ev += [(ACT, s.adapters)]  # LoRA's rank-r intermediates (freed by block_backward)
    if not keep:
        ev += [(cat, -y), (ACT, -s.nde)]  # norm2 output and x1
    elif s.cast:
        ev += [(ACT, -s.nde), (ACT, -s.nde)]  # x (not saved in low precision) and x1
    elif fresh:
        ev += [(ACT, -s.nde)]  # x: the first norm saved no fp32 alias of it
    return ev


def block_recompute(s: Sizes, *, selective: bool = False) -> list[Event]:
    """Checkpointed block, in backward: its forward again with everything saved; the
    input stays (the checkpoint holds it) and the recomputed output is dropped.
    Selective: the saved outputs are taken, not recomputed — modeled as released
    and allocated again by the recompute, except down_proj's, which stays to the
    end of the block's backward (``selective_backward_end``)."""
    ev = block_forward(s, keep=True)
    if s.cast:
        ev = [*ev[:-2], (ACT, -s.nde)]  # keep x, free x1
    stays = s.nme + xc.row_collective(s)  # down_proj's output and its reduced copy
    taken: list[Event] = [(ACT, -(selective_saved(s) - stays))] if selective else []
    return [*taken, *ev, (ACT, -s.nde)]


def selective_backward_end(s: Sizes) -> list[Event]:
    """The checkpoint frame dies with the block's backward: down_proj's saved output
    and its reduced copy under tp (never taken by the early-stopped recompute) go with
    it ([Note: selective checkpointing of exchanges])."""
    return [(ACT, -(s.nme + xc.row_collective(s)))]


def norm_backward(s: Sizes) -> list[Event]:
    """Backward of RMSNorm with the output's grad (N*d*e) live; ends with the
    input's grad accumulated in place into the residual grad, saved tensors freed."""
    if s.cast and s.norm_casts_first:
        ev = _cast_first_grad(s)
    else:
        ev = [(TEMP, s.nd4), (TEMP, -s.nde)] if s.cast else []
        if s.norm_grads:
            ev += [(TEMP, s.nd4), (TEMP, -s.nd4), (GRAD, s.d * s.e)]  # weight grad: (g*xn).sum
            ev += [(TEMP, s.nd4), (TEMP, ForWeights(-s.nd4)), (ACT, -s.nd4)]  # grad of xn; g, xn
            ev += [(ACT, -4 * s.d)] if s.cast else []
        else:
            ev += [(TEMP, s.nd4), (TEMP, -s.nd4)]  # grad of xn (no weight grad, nothing saved)
    ev += [(TEMP, s.nd4), (TEMP, s.nd4), (TEMP, -s.nd4), (TEMP, -s.nd4)]  # grad of xf, of r
    ev += [(ACT, -4 * s.n), (TEMP, s.nd4)]  # rsqrt released; mean's expanded grad
    ev += [(TEMP, 3 * s.nd4), (TEMP, -4 * s.nd4)]  # pow: g*(2*x.pow(1)), folded into xf's
    ev += [(ACT, -s.nd4)]  # xf released (in fp32 the input itself)
    if s.cast:
        ev += [(TEMP, s.nde), (TEMP, -s.nd4)]  # ToCopyBackward to the input dtype
    return [*ev, (TEMP, -s.nde)]  # accumulated in place into the residual grad


def _cast_first_grad(s: Sizes) -> list[Event]:
    """``weight * xn.to(e)`` backward (``Sizes.norm_casts_first``): the weight's grad
    and the cast's in e, the output's grad dies, then the cast's grad to fp32 (xn's)."""
    w: list[Event] = [(TEMP, s.nde), (TEMP, -s.nde), (GRAD, s.d * s.e)] if s.norm_grads else []
    g = ForWeights(-s.nde) if s.norm_grads else -s.nde
    ev = [*w, (TEMP, s.nde), (TEMP, g)] + ([(ACT, -s.nde)] if s.norm_grads else [])
    return [*ev, (TEMP, s.nd4), (TEMP, -s.nde)]


def _mlp_backward(s: Sizes) -> list[Event]:
    """down, (silu*up), up, silu, gate — autograd runs the later-created node first."""
    dfe = s.d * s.f * s.e
    cat, y = xc.projection_input(s)
    frozen = s.frozen_linears  # down_proj's input and the gate / up input: freed in forward
    h: list[Event] = [] if frozen else [(ACT, -s.nfe)]
    y_freed: list[Event] = [] if frozen else [(cat, -y)]
    return [
        *xc.grad_gather(s, 1), (TEMP, s.nfe), (GRAD, dfe), *h,
        *xc.grad_gather(s, -1, True),
        (TEMP, 2 * s.nfe), (TEMP, -s.nfe), (ACT, -2 * s.nfe),
        (TEMP, s.nme), (GRAD, dfe), (TEMP, ForWeights(-s.nfe)),
        (TEMP, s.nfe), (TEMP, -s.nfe), (ACT, -s.nfe),
        (TEMP, s.nme), (GRAD, dfe), (TEMP, ForWeights(-s.nfe)), *y_freed, (TEMP, -s.nme),
        *xc.grad_scatter(s),
    ]  # fmt: skip


def _rope_backward(size: int) -> list[Event]:
    """Grad through x*cos + cat(-x2, x1)*sin, the rotated grad (``size``) live; leaves
    the input's grad and frees the incoming one."""
    return [
        (TEMP, size), (TEMP, size), (TEMP, size // 2), (TEMP, -size),
        (TEMP, size), (TEMP, -(size // 2)), (TEMP, -size),
        (TEMP, size), (TEMP, -size), (TEMP, -size),
    ]  # fmt: skip


def _attn_backward(s: Sizes, *, sdpa_workspace: int) -> list[Event]:
    rep = s.rep
    q, kv = s.nqe, s.nke
    wq, wkv = s.d * s.heads * s.head_dim * s.e, s.d * s.kv_heads * s.head_dim * s.e
    ev: list[Event] = [*xc.grad_gather(s, 1), (TEMP, q), (GRAD, wq), *xc.grad_gather(s, -1, True)]
    ev += [(ACT, -q)] if s.cp > 1 else []  # o_proj's input (the exchanged-back output)
    ev += xc.exchange(s, q)  # the output's grad: sequence for heads
    if s.ring and s.cp > 1:
        ev += ring_backward(s, sdpa_workspace=sdpa_workspace)
    else:
        ev += [(TEMP, q + 2 * s.nse + sdpa_workspace), (TEMP, -sdpa_workspace), (TEMP, -q)]
    ev += xc.exchange(s, 3 * q)  # q, k, v grads back (before the GQA sum)
    ev += [(ACT, -(2 * q + 2 * s.nse + s.nh4))]
    if rep > 1 and s.ring and s.cp > 1:  # ring: both grads are views of one buffer
        ev += [(TEMP, kv), (TEMP, kv), (TEMP, -2 * q)]
    elif rep > 1:  # sum the repeated heads back: v first, then k
        ev += [(TEMP, kv), (TEMP, -q), (TEMP, kv), (TEMP, -q)]
    ev += _rope_backward(kv) + _rope_backward(q)
    cat, y = xc.projection_input(s)
    kvf, qf = ForWeights(-kv), ForWeights(-q)
    ev += [(TEMP, s.nme), (GRAD, wkv), (TEMP, kvf)]  # v_proj
    ev += [(TEMP, s.nme), (GRAD, wkv), (TEMP, kvf), (TEMP, -s.nme)]  # k_proj, accumulated
    ev += [(TEMP, s.nme), (GRAD, wq), (TEMP, qf), (TEMP, -s.nme)]  # q_proj
    ev += [] if s.frozen_linears else [(cat, -y)]  # its input (freed in forward if frozen)
    return ev + xc.grad_scatter(s)


def block_backward(
    s: Sizes, *, sdpa_workspace: int = 0, held: int = 0, fresh: bool = False
) -> list[Event]:
    """Backward of one block with its saved tensors live (kept or recomputed) and the
    output's grad (N*d*e, counted by the caller) live; ends with the input's grad in
    the same buffer, all saved tensors freed and the weight grads (GRAD) allocated.
    ``held``: of the block's two residual sums (after the MLP's backward, then after
    attention's), the first ``held`` cannot sum in place, because another holds the
    summand (a pipeline stage's receive buffer; zero bubble's input pass keeping it
    for a weight's gradient): each makes a new tensor. ``fresh``: as ``block_forward``'s;
    no input gradient is made, so the first norm's backward does not run and the
    projections' input gradient dies."""
    norms = [norm_backward(s), norm_backward(s)]
    for i in range(held):
        norms[i] = [*norms[i][:-1], (TEMP, s.nde), norms[i][-1]]
    attn = _attn_backward(s, sdpa_workspace=sdpa_workspace)
    adapters: list[Event] = [(ACT, -s.adapters)] if s.adapters else []
    first = _fresh_norm_backward(s) if fresh else norms[1]
    return _mlp_backward(s) + norms[0] + attn + first + adapters


def _fresh_xn(s: Sizes) -> int:
    """What a norm whose input needs no gradient saves: its normalized input, for its
    weight's gradient (nothing when the weight is frozen)."""
    if not s.norm_grads:
        return 0
    return s.nde if s.cast and s.norm_casts_first else s.nd4


def _fresh_norm_forward(s: Sizes) -> list[Event]:
    """A block's first norm when its input needs no gradient (``block_forward``'s
    ``fresh``): no rsqrt or input copy saved, only ``_fresh_xn``."""
    xn = _fresh_xn(s)
    return [*_norm_forward_unsaved(s), *([(ACT, xn)] if xn else [])]


def _fresh_norm_backward(s: Sizes) -> list[Event]:
    """Its backward: the weight's gradient from ``_fresh_xn`` alone (no input gradient),
    and the projections' input gradient dies."""
    xn = _fresh_xn(s)
    weight: list[Event] = [(TEMP, xn), (TEMP, -xn), (GRAD, s.d * s.e), (ACT, -xn)] if xn else []
    return [*weight, (TEMP, -s.nme)]
