"""The DPO reference model in the plan: its shards for the whole step, its forward.

[Note: reference in the plan]
``train.objective = dpo`` changes three things a plan must see (fsdpkit.trainable.
reference, [Note: reference model]):

- every micro-batch holds 2 rows per pair (chosen and rejected), so the policy's
  activations, logits and inputs are planned at ``2 x train.micro_batch_size`` rows;
- with a separate reference (``lora.rank = 0``, loss sigmoid / ipo), its sharded
  parameters stay resident all step: ``sharded elements x bytes of
  dpo.reference_dtype`` per rank, no gradients, no optimizer state;
- each micro-batch first runs the reference forward under ``no_grad``: it keeps no
  activations, so what it adds at its peak is the all-gathered copies of the largest
  unit and the one FSDP2 prefetches next (in the reference dtype) plus its logits and
  the fp32 log-softmax of cross-entropy over the 2B x seq tokens. The layer-local
  temporaries of a no-grad forward are left out (they are one block's, far below the
  policy's own backward).

Under LoRA (the base with adapters off) and SimPO only the first applies.

``train.objective = grpo`` with ``rl.beta > 0`` has the same reference
(fsdpkit.trainable.reference.needs_reference_model decides for both): its shards for
the whole step, rollout included, and one no-grad forward per micro-batch of
completions before the updates, whose logits are GRPO's (``no_grad_logits`` in
fsdpkit.planner.model.grpo_terms); its rows are not doubled.

With ``parallel.tp`` / ``parallel.cp`` the reference is split like the policy: its units
are the policy's tp-local units (``tp_layout``), FSDP-sharded over the same shard x cp
ranks, so its shards and all-gathered copies divide by tp as the policy's do; its
logits are gathered whole over the vocabulary on every tp rank, and under cp each rank
computes the logits of its seq / cp tokens only. Under ``parallel.pp`` a rank holds
its stages of the reference (``stage_scenario`` in fsdpkit.planner.pipeline.plan: the
stage's units, the logits on the last stage only), and its pass through them runs
before the schedule (fsdpkit.planner.pipeline.replay).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fsdpkit.config import RunConfig
from fsdpkit.planner.model.grpo_terms import GrpoTerms, no_grad_logits
from fsdpkit.planner.model.unit_layout import Unit

TRACE_NOTE = (
    "micro-batches planned at 2 rows per pair with full logits (the analytic plan; "
    "--trace traces the policy's language-model step at train.micro_batch_size rows "
    "and no reference)"
)


@dataclass(frozen=True)
class ReferenceTerms:
    """What a DPO run adds to a plan ([Note: reference in the plan])."""

    rows_per_pair: int
    """Micro-batch rows per configured micro-batch entry (2 for DPO, else 1)."""
    resident: int = 0
    """The reference's sharded parameters per rank (bytes)."""
    forward: int = 0
    """What its no-grad forward holds at its peak besides them (bytes; before the rows
    are known it is per micro-batch row: see ``reference_terms``)."""
    note: str | None = None


def reference_terms(
    cfg: RunConfig,
    *,
    units: Sequence[Unit],
    rows: int,
    seq_len: int,
    vocab: int,
    low: bool,
    grpo: GrpoTerms | None = None,
    buffers: int = 0,
) -> ReferenceTerms:
    """The terms for ``cfg`` with ``rows`` policy micro-batch rows (already doubled),
    ``units`` the policy's (tp-local) units and ``low``: the run computes in bf16;
    ``grpo``: a GRPO run's terms (its reference forward's logits); ``buffers``: the
    model's buffers (GRPO's reference holds its own)."""
    if grpo is not None:
        return _grpo_reference(cfg, units, grpo, rows=rows, vocab=vocab, low=low, buffers=buffers)
    if cfg.train.objective != "dpo":
        return ReferenceTerms(rows_per_pair=1)
    if cfg.dpo.loss == "simpo" or cfg.lora.rank:
        return ReferenceTerms(rows_per_pair=2, note=f"DPO: no reference model; {TRACE_NOTE}")
    elem = _reference_bytes(cfg, low=low)
    tokens = rows * seq_len // cfg.parallel.cp  # this cp rank's slice of every row
    logits = tokens * vocab * (elem + 4 + (4 if elem == 2 else 0))
    return ReferenceTerms(
        rows_per_pair=2,
        resident=elem * sum(u.sharded for u in units),
        forward=_two_largest(units, elem) + logits,
        note=(
            f"DPO: a frozen reference model ({'bf16' if elem == 2 else 'fp32'}, sharded, "
            f"forward only) beside the policy; {TRACE_NOTE}"
        ),
    )


def _reference_bytes(cfg: RunConfig, *, low: bool) -> int:
    """Bytes per element of the reference: ``dpo.reference_dtype``, auto = the run's."""
    wanted = cfg.dpo.reference_dtype
    return 2 if wanted == "bf16" or (wanted == "auto" and low) else 4


def _two_largest(units: Sequence[Unit], elem: int) -> int:
    """The largest unit's all-gathered copy and the one FSDP2 gathers next."""
    return elem * sum(sorted((u.gathered for u in units), reverse=True)[:2])


def _grpo_reference(
    cfg: RunConfig,
    units: Sequence[Unit],
    grpo: GrpoTerms,
    *,
    rows: int,
    vocab: int,
    low: bool,
    buffers: int,
) -> ReferenceTerms:
    """GRPO's KL reference (``rl.beta > 0``): the DPO rule at GRPO's logits, and the
    trainer's own test of whether a second model is built. Its buffers (the built-in
    model's RoPE tables) are its own copies, resident like its shards (measured on 2
    gloo ranks: the plan was short by exactly them; DPO's plans leave them out)."""
    # here, not at the top: it imports the sharding machinery, which other plans skip
    from fsdpkit.trainable.reference import needs_reference_model

    if not needs_reference_model(cfg):
        kl = "GRPO: KL to the base model with the LoRA adapters off (no second model)"
        return ReferenceTerms(rows_per_pair=1, note=kl if grpo.ref_logps else None)
    elem = _reference_bytes(cfg, low=low)
    return ReferenceTerms(
        rows_per_pair=1,
        resident=elem * sum(u.sharded for u in units) + buffers,
        forward=_two_largest(units, elem) + no_grad_logits(grpo, rows=rows, vocab=vocab, e=elem),
        note=(
            f"GRPO: a frozen reference model for the KL term ({'bf16' if elem == 2 else 'fp32'}, "
            "sharded, forward only) beside the policy, in both phases"
        ),
    )
