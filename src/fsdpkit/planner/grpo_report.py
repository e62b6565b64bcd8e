"""How a GRPO plan reads ([Note: the GRPO step in the plan] in
fsdpkit.planner.model.grpo_terms): which phase peaks, the rollout's make-up, the
training phase's peak. Formats only; the figures come from ``Plan.grpo``
(fsdpkit.planner.replay.rolloutmem.GrpoPhases)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from fsdpkit.planner.shapes.result import ALL_CATEGORIES, ROLLOUT, Plan


def grpo_lines(p: Plan, *, size: Callable[[int], str]) -> list[str]:
    """The report's GRPO lines (none for other objectives); ``size`` formats bytes."""
    if p.grpo is None:
        return []
    g, sc = p.grpo, p.scenario
    t, terms = g.training, sc.grpo
    assert terms is not None  # a GRPO plan's scenario has its terms
    training = f"{size(t.bytes)} at {t.phase}" + (f": {t.where}" if t.where else "")
    lines = [
        f"GRPO: the {g.peak_phase} phase peaks; training phase {training} (micro-batches of "
        f"{sc.micro_batch} completions x {sc.seq_len} tokens, GRPO's loss on full logits)"
    ]
    r = g.rollout
    if terms.engine == "vllm":
        return [
            *lines,
            f"GRPO rollout phase {size(r.peak)} at {r.where}: a vLLM engine beside the rank "
            f"with the whole model and a KV cache of {size(r.kv_cache)} "
            f"({terms.decode_batches} x {terms.rows} sequences of {terms.seq_len} tokens)",
        ]
    made = f"KV cache {size(r.kv_cache)} at full length, prefill logits {size(r.logits)}"
    if g.why_not:
        made = "only the gathered model counted (see the note)"
    return [
        *lines,
        f"GRPO rollout phase {size(r.peak)} at {r.where}: one decode batch = one prompt's "
        f"{terms.rows} completions x {terms.seq_len} positions ({terms.prompt_len} prompt + "
        f"{terms.completion_len} completion), {terms.decode_batches} per rank per step; "
        f"gathered parameters {size(r.gathered)}, {made}",
    ]


def category_labels(p: Plan) -> dict[str, str]:
    """The breakdown's rows and labels: GRPO's reference is its KL term's."""
    if p.grpo is None:
        return ALL_CATEGORIES
    return ALL_CATEGORIES | {"reference": "KL reference model (frozen, forward only)"}


def unfit_phase(p: Plan) -> str:
    """What a GRPO plan's DOES NOT FIT adds: the phase that does not fit."""
    if p.grpo is None:
        return ""
    if p.grpo.peak_phase == ROLLOUT:
        return " in the rollout phase: the gathered model, its KV cache and logits"
    return " in the training phase"


def grpo_dict(p: Plan) -> dict[str, Any] | None:
    """The JSON of ``Plan.grpo`` (None without GRPO: the key is then left out)."""
    g, terms = p.grpo, p.scenario.grpo
    if g is None or terms is None:
        return None
    return {
        "terms": dataclasses.asdict(terms),
        "peak_phase": g.peak_phase,
        "rollout": dataclasses.asdict(g.rollout),
        "training": dataclasses.asdict(g.training),
        "why_not": g.why_not,
    }
