"""What a plan says about a mixture-of-experts model, beyond its traced peak.

[Note: routed activations in the plan]
The traced step routes fake tokens, so its peak is one routing's. That is every
routing's where the experts run as transformers' grouped (or batched) GEMMs: each MoE
layer's expert inputs, intermediates and outputs are tokens x top_k rows however the
router splits them (the per-expert group sizes change only the offsets), so the
typical step (balanced or not) and the worst one (every token of a layer choosing the
same experts) hold the
same activation memory under FSDP. Measured on 2 gloo ranks by
bench/moe_routing_memory.py (Mixtral and Qwen3-MoE, 4 experts, top 2): the median
step peak and the trace are equal (0.00%) whether the busiest expert held 1.22-1.32x
its balanced share or 2.0x (every token of a layer chose it, the worst top-2
allows); the steps above the median (+0.8 to +1.2 MiB) fall at any load, balanced as
well as collapsed: they are FSDP's late frees ([Note: late frees]), which the plan's
reported spread covers, as on dense rows.
With expert parallelism a rank computes the rows the whole ep group routed to its
experts: tokens x top_k in a balanced step (what the trace routes, [Note: expert
parallelism in the plan] in fsdpkit.planner.traced.fake_patches), up to ep x tokens x top_k
when every ep rank's tokens choose its experts; the note states that bound beside the
traced peak.

The router loss of transformers' families (fsdpkit.loss.router) gathers every data
rank's router logits, so its buffers grow with the data-parallel world: layers x dp x
tokens x experts values per micro-batch on every rank, kept for backward when the loss
counts. The traced peak includes them; the note gives their size so that a user
planning a larger world sees the term that grows. The built-in MoE model's router loss
all-reduces per-expert sums instead (fsdpkit.loss.balance): nothing of it grows with
the world.
"""

from __future__ import annotations

from fsdpkit.loss.router import RouterSpec
from fsdpkit.models.experts import Experts, fmt_count
from fsdpkit.planner.experts.routing import BALANCED, MEAN_KEY, Routing

ROUTING_FREE = ("grouped_mm", "batched_mm")
"""transformers' experts kernels whose buffers do not depend on the routing."""
LOGIT_BYTES = 4
"""Bytes per gathered router value as the aux loss computes it (fp32 softmax)."""


def moe_notes(
    experts: Experts | None,
    router: RouterSpec | None,
    *,
    dp: int,
    tokens: int,
    cp: int = 1,
    ep: int = 1,
    tp: int = 1,
    pp: int = 1,
    routing: Routing = BALANCED,
) -> tuple[str, ...]:
    """The plan's notes for a MoE model (empty for a dense one); ``tokens`` per
    micro-batch of one data-parallel rank (a rank holds its 1 / cp of them, and routes
    its 1 / tp of those: [Note: experts under tensor parallelism] in
    fsdpkit.sharding.tensor.moe)."""
    if experts is None:
        return ()
    tokens //= tp
    dp *= tp  # the router loss's ranks: each holds its own tokens
    rows = tokens // cp * experts.top_k
    gathers = "every expert" if ep == 1 else f"its ep rank's {experts.count // ep} experts"
    notes = [
        f"mixture of experts: memory counts all {fmt_count(experts.total)} parameters "
        f"(FSDP shards and updates every expert, and gathers {gathers}), step time the "
        f"{fmt_count(experts.active)} a token runs through",
        _routed(experts, rows=rows, tokens=tokens // cp)
        if ep == 1
        else _ep_rows(experts, rows, ep, routing),
    ]
    if tp > 1:
        notes.append(
            f"tensor parallel {tp} with experts: each tp rank routes its own 1 / {tp} of the "
            "tokens; the routed experts and the router are whole on every tp rank (sharded "
            "by FSDP over the data ranks only), their gradients summed over tp"
        )
    if router is not None and router.aux_fn is not None:
        if pp > 1:
            notes.append(
                "router loss: per-expert sums carried across the pipeline stages with the "
                "hidden states ([Note: the router loss across stages]), a few numbers per "
                "micro-batch: nothing of it grows with the world"
            )
        elif router.gathered:
            notes.append(_router_buffers(experts, router, dp=dp, tokens=tokens))
        else:
            notes.append(
                "router loss: per-expert sums all-reduced over the ranks (fsdpkit.loss."
                "balance), a few numbers per layer: nothing of it grows with the world"
            )
    return tuple(notes)


def _ep_rows(experts: Experts, rows: int, ep: int, routing: Routing) -> str:
    sends = (
        f"expert parallel {ep}: each MoE layer sends {rows} rows per micro-batch (tokens x "
        f"top {experts.top_k}) to the ranks holding their experts and back"
    )
    bound = (
        f"a step whose routing sends every ep rank's tokens to one rank's experts gives "
        f"that rank {ep * rows} rows in its grouped GEMMs, all-to-all buffers and their "
        "saved activations ([Note: routed activations in the plan])"
    )
    if routing == BALANCED:
        return (
            f"{sends}; planned routing: {routing.describe()}, where a rank computes {rows} "
            f"rows; a real router sends some ranks more (a run under ep records it per "
            f"step as {MEAN_KEY} in metrics.jsonl: plan at it with --moe-imbalance RUN_DIR "
            f"or a number); {bound}"
        )
    return (
        f"{sends}; planned routing: the busiest ep rank receives {routing.describe()} "
        f"([Note: routing in the plan]); {bound}"
    )


def _routed(experts: Experts, *, rows: int, tokens: int) -> str:
    if experts.implementation in ROUTING_FREE:
        return (
            f"routed activations: each of the {experts.layers} MoE layers runs {rows} rows "
            f"per micro-batch (tokens x top {experts.top_k}) as {experts.implementation} "
            "GEMMs, whose buffers do not depend on the routing: the peak holds for balanced "
            "and worst routing alike ([Note: routed activations in the plan])"
        )
    return (
        f"routed activations: experts implementation {experts.implementation!r} sizes "
        "each expert's buffers by its tokens; the plan traces one routing and does not "
        f"bound the worst (every one of a layer's {tokens} tokens on one expert)"
    )


def _router_buffers(experts: Experts, router: RouterSpec, *, dp: int, tokens: int) -> str:
    values = experts.layers * dp * tokens * experts.count
    size = values * LOGIT_BYTES / 2**20
    kept = "kept for backward" if router.coef else "freed at once (coefficient 0)"
    return (
        f"router loss: every rank gathers all {dp} data ranks' router logits, "
        f"{experts.layers} layers x {dp} x {tokens} tokens x {experts.count} experts = "
        f"{values:,} values ({size:.1f} MiB in fp32) per micro-batch, {kept}; this term "
        "grows with the data-parallel world (in the traced peak)"
    )
