"""Analytic per-rank memory: one training step of FSDP2 replayed over the shapes.

No tensors, no process group: the step is walked the way FSDP2 (torch 2.13) and
autograd run it, unit by unit, and every allocation and free goes into a ``Ledger``
that keeps the peak. What is modeled, and why (see docs/planner.md for the proofs):

- Model states: fp32 sharded parameters (the master copy; FSDP2 casts only the
  all-gathered copy), AdamW's two fp32 states, and fp32 sharded gradients that appear
  unit by unit during backward (the previous step's ``zero_grad`` set them to None):
  16 bytes per parameter / shard degree at the optimizer step (ZeRO-3 arithmetic).
- Unsharded parameters: the root unit for the whole forward; an untied embedding,
  final norm and head as units of their own ([Note: edge units] in
  fsdpkit.sharding.edges): the embedding like a block unit, norm and head from their
  forward to their backward, which comes first; each block unit from its
  pre-forward until its post-forward reshard (never, for the last unit when resharding
  is True, and for every unit under grad_op); in backward the current unit plus the
  all-gather output of the one prefetched. In forward FSDP2 keeps the previous
  all-gather's flat output until the next unit's copy-out (``all_gather_state``).
- Reduce-scatter: the flat input (reduce dtype) allocated after the unit's unsharded
  grads are copied in, kept until the next unit's post-backward.
- Accumulation ([Note: accumulation modes] in fsdpkit.sharding.grads): ``last`` keeps
  every unit's unsharded gradient (reduce dtype) from the first micro-batch's
  backward to the last one's; ``every`` reduce-scatters each micro-batch: the first
  creates the sharded gradients, later ones allocate the reduce-scatter output and add
  it in (HSDP: a sharded partial sum in the reduce dtype until the last micro-batch's
  all-reduce).
- Explicit prefetch ([Note: explicit prefetch] in fsdpkit.sharding.apply): the
  all-gather outputs of up to ``forward_prefetch`` units ahead in forward and
  ``backward_prefetch`` units ahead in backward, from the prefetch to their copy-out.
- The optimizer step's temporary: foreach allocates sqrt(v) of the whole 2-D group,
  for-loop two of the largest parameter, fused none ([Note: AdamW kernels]).
- Activations, logits, loss and temporaries: [Note: block event model] in blockmem.
- GRPO ([Note: the GRPO step in the plan] in fsdpkit.planner.model.grpo_terms): the
  no-grad recompute (and reference) forwards before the updates, which leave the root
  and the norm / head units gathered for the first update's forward, the GRPO loss
  head ([Note: GRPO loss head memory]); the rollout phase: [Note: rollout memory].
"""

from __future__ import annotations

from fsdpkit.planner.errors import PlanError
from fsdpkit.planner.model.grpo_terms import no_grad_logits
from fsdpkit.planner.replay.fsdpunits import UNSH
from fsdpkit.planner.replay.walk import Step
from fsdpkit.planner.shapes.result import MemoryPlan
from fsdpkit.planner.shapes.scenario import Scenario
from fsdpkit.planner.shapes.states import model_states


def require_decoder_blocks(sc: Scenario) -> None:
    """The analytic model knows the activations of Llama decoder layers op by op (fsdpkit's
    and transformers' Llama/Mistral ones); units of other modules it cannot replay (the
    traced planner runs any model: ``plan()`` switches to it)."""
    if sc.analytic_why_not is None and sc.model is not None:
        return
    raise PlanError(
        f"the analytic planner models Llama decoder-layer units, but this run has "
        f"{sc.analytic_why_not or 'other units'}. Plan it with --trace (runs the real "
        "model under fake tensors), or leave parallel.block_classes empty."
    )


def analytic_memory(sc: Scenario) -> MemoryPlan:
    """Per-rank memory of one steady-state step of ``sc``, from shapes alone."""
    require_decoder_blocks(sc)
    step = Step(sc)
    step.persistent()
    step.led.add("reference", sc.reference_bytes)  # [Note: reference in the plan]
    if sc.grpo is not None:
        before_updates(step)
    micro = [0] if sc.grad_accum == 1 else [0, sc.grad_accum - 1]
    for index in micro:
        step.last_micro = index == sc.grad_accum - 1
        if sc.reference_forward and sc.grpo is None:  # its no-grad forward, transient
            step.led.at("forward", "reference model forward (no grad)")
            step.led.add("reference", sc.reference_forward)
            step.led.add("reference", -sc.reference_forward)
        step.forward()
        step.backward(sync=step.last_micro or sc.every_sync)
    step.optimizer()
    states = model_states(sc)
    host = sum(states.values()) if step.host_states else 0
    return MemoryPlan(
        mode="analytic",
        peak=step.led.peak,
        phase_peaks=dict(step.led.phase_peaks),
        model_states=states,
        host_bytes=host,
        spread=late_free_spread(sc),
    )


def before_updates(step: Step) -> None:
    """GRPO's no-grad forwards before its updates, once per micro-batch: the trainer's
    recompute of the sampled tokens' log-probs (the largest unit and the next one
    gathered, GRPO's logits: the DPO reference's rule, [Note: reference in the plan]),
    then the reference's. What a forward does not reshard (the root, the norm and head
    units: [Note: edge units], the last block unit; checked on 2 gloo ranks) stays
    gathered into the first update's forward."""
    sc, led, e = step.sc, step.led, step.s.e
    assert sc.grpo is not None and sc.model is not None
    units = sorted((u.gathered for u in sc.all_units), reverse=True)[:2]
    logits = no_grad_logits(sc.grpo, rows=sc.micro_batch, vocab=sc.model.vocab_size, e=e)
    led.at("forward", "GRPO recompute of the sampled tokens' log-probs (no grad)")
    led.apply([("temporaries", e * sum(units) + logits), ("temporaries", -e * sum(units) - logits)])
    if sc.reference_forward:
        led.at("forward", "GRPO reference log-probs (no grad)")
        led.apply([("reference", sc.reference_forward), ("reference", -sc.reference_forward)])
    for u in (sc.root, *sc.forward_units):  # what a forward leaves gathered
        raf, full = step.reshard_of(u), u.gathered * e
        keep = full if raf is False else 0 if raf is True else full // int(raf)
        if keep:
            step.held[u.name] = keep
            led.add(UNSH, keep)


def late_free_spread(sc: Scenario) -> int:
    """[Note: late frees]
    FSDP2 keeps a unit's flat all-gather output until the next unit's copy-out; the
    collective's work object holds a reference too, and it is dropped by the backend's
    thread (gloo) or when the stream event is reached (NCCL), not at a fixed point of
    the step. On some steps one such buffer is therefore still alive at the moment
    the modeled peak happens: measured on gloo, 1-8 MB on 8 of 28 steps of one
    configuration (+1.7%). On gloo the late buffer comes with the backend's
    temporary of the same size: "T bf16 full +AC" reads +0.69 MiB on some steps, two
    of its 0.346 MiB block all-gathers. The planner models the typical step and
    reports, as the spread, the largest all-gather output of any unit (twice that on
    gloo): peak + spread bounds the worst step (bench/plan_accuracy.py checks it)."""
    if sc.dims.fsdp_shard <= 1:
        return 0
    copies = 2 if sc.device.kind != "gpu" else 1  # gloo: output and temporary
    return copies * max(u.gathered for u in sc.all_units) * sc.param_bytes
