"""The analytic planner's ring attention (parallel.cp_attention = "ring"): its buffers
([Note: ring attention memory] in fsdpkit.planner.replay.ringmem), its traffic and its heads
rule (heads need not divide by cp)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fsdpkit.config import load
from fsdpkit.planner import plan
from fsdpkit.planner.errors import PlanError
from fsdpkit.planner.formatting import format_plan
from fsdpkit.planner.replay.blockmem import Sizes, block_backward, block_forward
from fsdpkit.planner.replay.ringmem import ring_backward, ring_forward
from fsdpkit.planner.shapes.mparallel import exchange_traffic

A = [  # bench/plan_accuracy_cases.py's model A at dp2 x cp2
    "model.dim=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
    "model.ffn_dim=688", "model.vocab_size=2048", "data.seq_len=512",
    "train.micro_batch_size=2", "parallel.cp=2", "precision.mode=fp32",
]  # fmt: skip
RING = "parallel.cp_attention=ring"


def _peak(events: list[tuple[str, int]]) -> tuple[int, int]:
    live = top = 0
    for _, b in events:
        live += b
        top = max(top, live)
    return top, live


def test_ring_events_balance_and_peak_above_ulysses() -> None:
    # m = 512 tokens per rank, Q = 512 x 4 heads x 64 x 4 bytes = 512 KiB
    s = Sizes(n=512, d=256, f=688, heads=4, kv_heads=2, head_dim=64, vocab=2048, e=4, cp=2)
    ring = replace(s, ring=True)
    for sz in (s, ring):  # both leave the same saved set / grads behind
        assert _peak(block_forward(sz, keep=True))[1] == _peak(block_forward(s, keep=True))[1]
    assert _peak(block_backward(ring))[1] == _peak(block_backward(s))[1]
    q = 512 * 4 * 64 * 4
    # forward: the k / v gather (cp x 2Q) and the merge's temporaries on top of the
    # saved q, k, v; backward: fp32 accumulators, the gather and the rotated grads
    assert _peak(block_forward(ring, keep=True))[0] >= _peak(block_forward(s, keep=True))[0]
    lse = 4 * 512 * 4
    # the gather (4Q) + the concatenation (2Q) + step 0's block, then the merge's two
    # temporaries beside the state and step 1's block (the concatenation freed)
    assert _peak(ring_forward(ring)) == (8 * q + 3 * lse, q + lse)
    # 3 fp32 accumulators + the concatenation + gather + step 0's grads + the sent and
    # received k / v grads (16Q), then step 1's grads (rank 0: 2.5Q) with the
    # concatenation still bound (torch's ``next_kv``); leaves the q, k, v grads for
    # the output's grad
    assert _peak(ring_backward(ring, sdpa_workspace=0)) == (37 * q // 2, 2 * q)
    # CPU ranks: gloo's gathering temporary (cp x 2Q) lives to the first wait, over
    # step 0's block in forward and step 0's grads and first permute in backward
    gloo = replace(ring, gloo=True)
    assert _peak(ring_forward(gloo)) == (11 * q + lse, q + lse)
    assert _peak(ring_backward(gloo, sdpa_workspace=0)) == (20 * q, 2 * q)


def test_ring_plan_peak_and_traffic() -> None:
    ring = plan(load(None, [*A, RING]), world_size=4)
    ulysses = plan(load(None, A), world_size=4)
    assert ring.scenario.cp_attention == "ring"
    assert ring.memory.peak.bytes > ulysses.memory.peak.bytes
    q, blocks = 512 * 4 * 64 * 4, 4  # no AC: one forward and one backward per block
    # per pass the repeated k, v gathered ((cp - 1) x 2Q); per backward the fp32 k / v
    # grads sent whole at each of the cp steps (cp x 2Q)
    assert ring.comm.cp_exchange == blocks * (2 * 2 * q + 2 * 2 * q)
    assert ulysses.comm.cp_exchange == blocks * 2 * (2 * q + 2 * q // 2) // 2
    assert ring.comm.calls - ulysses.comm.calls == blocks * (1 + 3) - blocks * 8
    assert "cp 2 (ring attention)" in format_plan(ring)
    assert "ring attention" not in format_plan(ulysses)


def test_ring_traffic_formula_at_cp4_bf16() -> None:
    model = plan(load(None, A), world_size=4).scenario.model
    assert model is not None
    tokens, e, cp = 4096, 2, 4
    q = tokens // cp * 4 * 64 * e
    _, cp_bytes, calls = exchange_traffic(
        model, tp=1, cp=cp, sp=False, tokens=tokens, e=e, passes=3, ring_backwards=1
    )
    assert cp_bytes == 3 * (cp - 1) * 2 * q + cp * 2 * q * 4 // e
    assert calls == 2 + (1 + cp)


def test_ring_plans_heads_that_cp_does_not_divide() -> None:
    odd = [*A, "model.n_heads=6", "model.n_kv_heads=6", "model.dim=384", "parallel.cp=4"]
    with pytest.raises(PlanError, match=r"parallel\.cp = 4 must divide"):
        plan(load(None, odd), world_size=4)
    p = plan(load(None, [*odd, RING]), world_size=4)
    assert p.memory.mode == "analytic" and p.memory.peak.bytes > 0
