"""Ring attention's buffers inside one block pass, as alloc/free events for the block
event model ([Note: block event model] in fsdpkit.planner.replay.blockmem).

[Note: ring attention memory]
Under ``parallel.cp_attention = "ring"`` ([Note: ring attention] in
fsdpkit.sharding.context.ring) each cp rank keeps its m tokens and all its heads / tp; k and v
are repeated to the query heads first, so with Q = m x heads / tp x hd x e bytes
(one rank's query), L = its fp32 log-sum-exp and Qf = Q x 4 / e (fp32) the saved set
is Ulysses's: q, the repeated k and v, the output, L, and o_proj's input (the merged
output is (b, h, s, hd)-contiguous, so the model's transpose-reshape copies it).
What ring adds is transient, read from torch's ``_templated_ring_attention`` and its
backward (torch/distributed/tensor/experimental/_context_parallel/_attention.py,
default ``_cp_options``: ``rotate_method`` all-gather, ``convert_to_f32``):

- forward: k and v concatenated (2Q, held by the collective until its first wait)
  and all-gathered once (cp x 2Q, until the function returns); per step after the
  first the block output and L of the local queries against one k/v chunk, merged
  into the running (fp32) state by ``out - sigmoid(lse_b - lse) * (out - out_b)``:
  two Qf temporaries beside the state, the new state and the block. Modeled for the
  last rank, whose every step takes the whole local query (rank 0's later steps
  take half of it).
- backward: three fp32 accumulators (3 Qf), the k/v gather again (2Q + cp x 2Q;
  here the concatenation stays bound to ``next_kv`` until the next step's replaces
  it, to the end for the last one), per step the kernel's q / k / v grads while the
  previous step's are still bound (rank 0 after the first step: q halved, k and v
  whole, 2.5Q), and the k / v grad accumulators rotated by an all-to-all permute
  each step: the sent concatenation (2 Qf) and the received buffer (2 Qf), which
  becomes the next accumulator; the last received buffer is the k / v grad returned
  (one tensor: both grads die together). Modeled for rank 0, whose step after the
  first holds the most.
- the kernel's own workspace in backward (``sdpa_workspace``, fsdpkit.planner.replay.walk:
  FA2's fp32 dq accumulator and row sum, Qf + L, half of it at half q). The CPU
  kernel, measured: 0.25 Q of per-thread buffers at full q (one thread); at half q a
  contiguous copy of a half-q input (Q / 2) and 0.125 Q, besides torch's contiguous
  half of L: 0.12 Q above the modeled half, at a step that does not set the peak.
- on CPU ranks gloo's all-gather: a flattened copy of the concatenation (2Q, freed
  at once), then its worker thread's temporary of the output's size (cp x 2Q), live
  until the gather completes. That is after step 0's kernel as often as not (the
  thread gets its turn late on busy CPU ranks, or the peer posts late: still live
  after step 0's kernel on 7 of 8 rank-steps of "MP A dp2 x cp2 ring +AC", 1 of 8
  without checkpointing, profiled), so it is held to the first wait, which it
  cannot outlive; in backward it then meets step 0's grads and the first permute's
  buffers: 20Q at cp 2, the most of any step (the traced planner holds it the same
  way, fsdpkit.planner.traced.tracker).

Measured (bench/plan_accuracy.py, "MP A dp2 x cp2 ring" rows, fp32 on 4 gloo ranks,
6 steps each): +0.3% over the typical step without checkpointing (-0.01% on the
steps where the temporary was still live, +0.6% on the others) and -0.3% with full
checkpointing (-0.3% to +0.4% by step); the traced planner, which runs torch's ring
on fake tensors, agrees within 0.01%. With
the concatenation freed at the first wait in backward too and gloo's temporary inside
the call they read -1.5% and -3.7% (2Q under at rank 0's step 1, 3Q under at step 0
with the temporary still live).

Traffic (fsdpkit.planner.shapes.mparallel.exchange_traffic): the gather moves (cp - 1) x 2Q
per rank in each forward and backward; the permutes move cp x 2 Qf per backward.
"""

from __future__ import annotations

from fsdpkit.planner.replay.blocksizes import ACT, TEMP, XCHG, Event, Sizes


def _f32(s: Sizes, size: int) -> int:
    """``size`` bytes of compute dtype, in fp32 (torch's merge and accumulators)."""
    return size * 4 // s.e


def _gather(s: Sizes, size: int, *, sent: int) -> list[Event]:
    """The k / v all-gather's output (``size``) of the ``sent`` concatenation. On CPU
    ranks gloo first flattens the input into a copy (freed at once), then its worker
    thread gathers into a temporary of the output's size that lives until the gather
    completes, which is after the first step's kernel as often as not (the thread gets
    its turn late on busy CPU ranks): modeled live until the first wait, which it
    cannot outlive (``_gathered``)."""
    return [(XCHG, size), *([(TEMP, sent), (TEMP, -sent), (TEMP, size)] if s.gloo else [])]


def _gathered(s: Sizes, size: int) -> list[Event]:
    """The first wait on the gather: gloo's temporary is gone by then."""
    return [(TEMP, -size)] if s.gloo else []


def _merge(s: Sizes) -> list[Event]:
    """One merge of a block output (Q + L, live) into the fp32 state (Qf + L, live):
    the state is replaced; the block's fp32 copy (cast only) dies after."""
    lse, qf = s.nh4, _f32(s, s.nqe)
    ev: list[Event] = [(TEMP, qf)] if s.cast else []  # block_out.to(float32)
    ev += [(TEMP, lse), (TEMP, lse), (TEMP, -lse)]  # sigmoid(lse_b - lse)
    ev += [(TEMP, qf), (TEMP, qf), (TEMP, -qf), (TEMP, qf), (TEMP, -qf), (TEMP, -lse)]
    ev += [(TEMP, lse), (TEMP, lse), (TEMP, -lse), (TEMP, lse), (TEMP, -lse)]  # new lse
    ev += [(TEMP, -(qf + lse))]  # the old state
    return ev + ([(TEMP, -qf)] if s.cast else [])


def ring_forward(s: Sizes) -> list[Event]:
    """Ring attention's forward with q and the repeated k, v live; ends with its output
    and log-sum-exp allocated (ACT, as the block model's attention) and its buffers
    freed ([Note: ring attention memory])."""
    q, lse, cp = s.nqe, s.nh4, s.cp
    kv, gathered = 2 * q, cp * 2 * q
    ev: list[Event] = [(TEMP, kv), *_gather(s, gathered, sent=kv), (TEMP, q + lse)]  # step 0
    ev += [(TEMP, _f32(s, q) + lse)] if s.cast else []  # the fp32 state (else: the block)
    for i in range(1, cp):
        # the first wait frees the concatenation (only the collective held it)
        ev += [*_gathered(s, gathered), (TEMP, -kv)] if i == 1 else []
        ev += [(TEMP, kv), (TEMP, -kv)] if i < cp - 1 else []  # re-concatenated, unsent
        ev += [(TEMP, q + lse)]  # this step's block
        ev += [(TEMP, -(q + lse))] if i > 1 or s.cast else []  # the previous block
        ev += _merge(s)
    ev += [(TEMP, -(q + lse)), (XCHG, -gathered)]  # the last block, the gather
    if s.cast:  # the state cast back to the output; the fp32 state dies
        ev += [(TEMP, q), (TEMP, -_f32(s, q))]
    return [*ev, (TEMP, -(q + lse)), (ACT, q + lse)]


def ring_backward(s: Sizes, *, sdpa_workspace: int) -> list[Event]:
    """Ring attention's backward with the output's grad (Q, TEMP) and the saved tensors
    live; ends with the q grad and the k / v grads (one buffer) allocated, 3Q TEMP, and
    the output's grad freed ([Note: ring attention memory])."""
    q, cp, ws = s.nqe, s.cp, sdpa_workspace
    qf, kv, gathered = _f32(s, s.nqe), 2 * s.nqe, cp * 2 * s.nqe
    ev: list[Event] = [(TEMP, 3 * qf), (TEMP, kv), *_gather(s, gathered, sent=kv)]
    ev += [(TEMP, 3 * q + ws), (TEMP, -ws)]  # step 0's grads, summed in place
    ev += [(TEMP, 2 * qf), (XCHG, 2 * qf)]  # k / v grads sent (permute) and received
    prev = 3 * q
    for i in range(1, cp):
        ev += _gathered(s, gathered) if i == 1 else []
        # the concatenation stays bound (``next_kv``) until the next one replaces it
        ev += [(TEMP, kv), (TEMP, -kv)] if i < cp - 1 else []
        new = q // 2 + 2 * q  # rank 0: the second half of q against whole k, v
        ev += [(TEMP, new + ws // 2), (TEMP, -(ws // 2)), (TEMP, -prev), (TEMP, -2 * qf)]
        prev = new
        # the k / v accumulators become the received buffer (summed into in place)
        ev += [(TEMP, -2 * qf)] if i == 1 else [(XCHG, -2 * qf)]
        ev += [(TEMP, 2 * qf), (XCHG, 2 * qf)]  # sent again, the next one received
        ev += [(TEMP, qf), (TEMP, -qf)]  # grad q's second half updated (a new tensor)
    if s.cast:
        ev += [(TEMP, q), (TEMP, -qf)]  # grad q cast back
    ev += [(TEMP, -2 * qf), (XCHG, -2 * qf)]  # the last send's wait; old accumulators
    ev += [(TEMP, kv)] if s.cast else []  # the received k / v grads cast back
    ev += [(XCHG, -gathered), (TEMP, -prev), (XCHG, -2 * qf), (TEMP, -kv)]
    ev += [] if s.cast else [(TEMP, kv)]  # fp32: the received buffer is the result
    return [*ev, (TEMP, -q)]
