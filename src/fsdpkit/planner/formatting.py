"""Plans and recommendations as text, JSON-ready dicts and TOML lines.

Formatting only: every number here was computed by the planner.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fsdpkit.config.toml import dotted_tables, dump_tables, toml_value
from fsdpkit.models.experts import fmt_count
from fsdpkit.planner.grpo_report import category_labels, grpo_dict, grpo_lines, unfit_phase
from fsdpkit.planner.pipeline.report import pipeline_dict, pipeline_lines
from fsdpkit.planner.search.recommendation import Candidate, Recommendation
from fsdpkit.planner.shapes.result import ALL_PHASES, MemoryPlan, Plan
from fsdpkit.planner.shapes.scenario import Scenario
from fsdpkit.planner.shapes.scenario_json import scenario_dict
from fsdpkit.strategies import strategy

GiB, MiB = 1024**3, 1024**2


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    if n == 0:
        return "0"
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.1f} MiB"


def _mesh(sc: Scenario) -> str:
    d = sc.dims
    ep = f"; expert parallel {d.ep} (experts sharded over {d.efsdp})" if d.ep > 1 else ""
    return _data_mesh(sc) + ep


def _data_mesh(sc: Scenario) -> str:
    chosen, d = strategy(sc.strategy), sc.dims
    if chosen.replicates:
        mesh = f"replicate x{d.replicate}"
    elif chosen.hybrid:
        mesh = f"{sc.strategy} {d.replicate} replicas x shard {d.fsdp_shard}"
    else:
        mesh = f"{sc.strategy} shard over {d.fsdp_shard}"
    stages = f"pp {d.pp} x " if d.pp > 1 else ""
    if d.tp == 1 and d.cp == 1:
        return f"{stages}{mesh}"
    sp = " (sequence parallel)" if sc.sequence_parallel else ""
    ring = " (ring attention)" if sc.cp_attention == "ring" else ""
    parts = [f"cp {d.cp}{ring}" if d.cp > 1 else "", f"tp {d.tp}{sp}" if d.tp > 1 else ""]
    folded = ", cp folded into the shard group" if d.cp > 1 else ""
    return f"{stages}{' x '.join(p for p in parts if p)} x {d.dp} data-parallel ({mesh}{folded})"


def describe_scenario(sc: Scenario) -> str:
    m, n = sc.model, sc.num_params
    params = f"{fmt_count(n)} params" if sc.experts is None else sc.experts.describe()
    n_blocks = len(sc.layout.blocks)
    shape = f"{m.n_layers} layers, d={m.dim}, vocab {m.vocab_size}" if m else f"{n_blocks} blocks"
    source = f"{sc.source}, " if sc.source else ""
    return (
        f"{source}{params} ({shape}); "
        f"{sc.dims.world} ranks: {_mesh(sc)}, reshard_after_forward={sc.reshard_after_forward}; "
        f"{sc.precision}; {sc.micro_batch} x {sc.seq_len} tokens x {sc.grad_accum} accumulation; "
        f"{'selective ' if sc.ac_mode == 'selective' else ''}AC on "
        f"{sc.checkpointed_blocks}/{n_blocks} blocks{'; CPU offload' if sc.offload else ''}\n"
        f"units: {len(sc.units)}{_experts(sc)}{_edges(sc)} + root ({sc.layout.block_reason})"
    )


def _experts(sc: Scenario) -> str:
    """The experts units under ep ([Note: expert units] in fsdpkit.planner.experts.parallel)."""
    return f" + {len(sc.expert_units)} experts" if sc.expert_units else ""


def _edges(sc: Scenario) -> str:
    """The edge units ([Note: edge units] in fsdpkit.sharding.edges), as " + embedding,
    norm, head"."""
    return f" + {', '.join(u.name for u in sc.forward_units if not u.blocks)}" if sc.edges else ""


def _device_line(p: Plan) -> str:
    dev = p.scenario.device
    if p.device_bytes is None:
        return f"device: {dev.name} (memory unknown: no fit verdict; pass --device-mem)"
    return (
        f"device: {dev.name}, {fmt_bytes(p.device_bytes)}; usable {fmt_bytes(p.usable_bytes)} "
        f"after {fmt_bytes(dev.runtime_reserve)} runtime reserve and {p.margin:.0%} margin"
    )


def _verdict(p: Plan) -> str:
    if p.fits is None or p.headroom is None:
        return ""
    if p.fits:
        return f"FITS ({fmt_bytes(p.headroom)} to spare)"
    return f"DOES NOT FIT ({fmt_bytes(-p.headroom)} over{unfit_phase(p)})"


def _breakdown_rows(p: Plan) -> list[str]:
    main, other = p.memory, p.other
    rows = [f"  {'':<46}{main.mode:>14}" + (f"{other.mode:>14}" if other else "")]
    for key, label in category_labels(p).items():
        a = main.peak.breakdown.get(key, 0)
        b = other.peak.breakdown.get(key, 0) if other else 0
        if a or b:
            rows.append(
                f"  {label:<46}{fmt_bytes(a):>14}" + (f"{fmt_bytes(b):>14}" if other else "")
            )
    total = f"  {'peak':<46}{fmt_bytes(main.peak.bytes):>14}"
    return [*rows, total + (f"{fmt_bytes(other.peak.bytes):>14}" if other else "")]


def format_plan(p: Plan) -> str:
    """The human report of one plan."""
    mem, sc = p.memory, p.scenario
    where = f"{mem.peak.phase}: {mem.peak.where}" if mem.peak.where else mem.peak.phase
    lines = [
        f"fsdpkit plan ({mem.mode}, {p.elapsed_s * 1000:.0f} ms): {describe_scenario(sc)}",
        _device_line(p),
        "",
        f"per-rank memory at the peak ({where}):",
        *_breakdown_rows(p),
        _spread_line(mem),
        f"  {_verdict(p)}" if p.fits is not None else "",
        "peak by phase: "
        + " | ".join(
            f"{ph} {fmt_bytes(mem.phase_peaks[ph])}" for ph in ALL_PHASES if ph in mem.phase_peaks
        ),
        *grpo_lines(p, size=fmt_bytes),
        _states_line(mem, sc),
        _loss_line(p),
        _comm_line(p),
        *pipeline_lines(p),
    ]
    if mem.host_bytes:
        lines.append(f"host memory per rank (CPU offload): {fmt_bytes(mem.host_bytes)}")
    if mem.staging_bytes:
        lines.append(
            f"host memory per rank for async checkpoint staging (kept for the run): "
            f"{fmt_bytes(mem.staging_bytes)}"
        )
    if p.data_host_bytes:
        lines.append(
            f"host memory per rank for the data path (mapped token shards): "
            f"{fmt_bytes(p.data_host_bytes)}"
        )
    notes = [*sc.notes, *mem.notes]
    lines += [f"note: {n}" for n in notes]
    return "\n".join(line for line in lines if line is not None)


def _spread_line(mem: MemoryPlan) -> str | None:
    if not mem.spread:
        return None
    return (
        f"  some steps peak up to {fmt_bytes(mem.spread)} higher (an all-gather buffer "
        f"freed late: {fmt_bytes(mem.peak.bytes + mem.spread)}; the margin covers it)"
    )


def _loss_line(p: Plan) -> str | None:
    if p.loss is None:
        return None
    if p.loss.chunk is None:
        return f"loss buffers per micro-batch: {fmt_bytes(p.loss.chosen)} (full logits)"
    return (
        f"loss buffers per micro-batch: {fmt_bytes(p.loss.chosen)} (chunked cross-entropy, "
        f"{p.loss.chunk}-token chunks; full logits would take {fmt_bytes(p.loss.full)})"
    )


def _states_line(mem: MemoryPlan, sc: Scenario) -> str:
    s = mem.model_states
    where = "host" if mem.host_bytes else "device"
    units = list(sc.all_units)
    trainable = sum(u.grads_numel for u in units)
    total = sum(u.numel for u in units)
    shard, tp = sc.dims.fsdp_shard, sc.dims.tp
    per = f"shard {shard}"
    if tp > 1:  # the blocks are split over tp too; embedding and head are not
        per = f"(tp {tp} x shard {shard}) in the blocks, / shard {shard} elsewhere"
        if sc.experts is not None:  # [Note: experts under tensor parallelism]
            per += " and in the routed experts and routers"
    why = (
        f"16 bytes/param / {per}"
        if trainable == total
        else f"{trainable / total:.2%} of the parameters train: grads and AdamW for those only"
    )
    return (
        f"model states per rank ({where}): params {fmt_bytes(s['sharded_params'])} + grads "
        f"{fmt_bytes(s['gradients'])} + AdamW {fmt_bytes(s['optimizer_states'])} = "
        f"{fmt_bytes(sum(s.values()))} ({why})"
    )


def _comm_line(p: Plan) -> str:
    c = p.comm
    line = (
        f"communication per rank per step: all-gather {fmt_bytes(c.all_gather)}, "
        f"reduce-scatter {fmt_bytes(c.reduce_scatter)}, all-reduce {fmt_bytes(c.all_reduce)} "
        f"({c.calls} collectives)"
    )
    if c.tp_exchange or c.cp_exchange:
        line += (
            f"; activation exchanges: tp {fmt_bytes(c.tp_exchange)}, cp all-to-all "
            f"{fmt_bytes(c.cp_exchange)}"
        )
    if c.ep_exchange:
        line += f"; expert dispatch all-to-all {fmt_bytes(c.ep_exchange)} (balanced routing)"
    if c.host_transfer:
        line += f"; host<->device {fmt_bytes(c.host_transfer)}"
    return line


def plan_dict(p: Plan) -> dict[str, Any]:
    """A JSON-ready dict of a plan (bytes as integers)."""
    sc = p.scenario
    out: dict[str, Any] = {
        "scenario": {
            **scenario_dict(sc),
            "units": [
                {
                    "name": u.name,
                    "params": u.numel,
                    "reshard_after_forward": u.reshard_after_forward,
                    "checkpointed_blocks": sum(u.checkpointed),
                }
                for u in [*sc.forward_units, *sc.expert_units, sc.root]
            ],
            "block_reason": sc.layout.block_reason,
            "model": sc.model.to_dict() if sc.model is not None else None,
            "source": sc.source or None,
            "params": sc.num_params,
            "experts": (
                None
                if sc.experts is None
                else dataclasses.asdict(sc.experts) | {"active": sc.experts.active}
            ),
            "device": dataclasses.asdict(sc.device),
        },
        "memory": dataclasses.asdict(p.memory),
        "comm": dataclasses.asdict(p.comm) | {"total": p.comm.total},
        "device_bytes": p.device_bytes,
        "usable_bytes": p.usable_bytes,
        "margin": p.margin,
        "fits": p.fits,
        "headroom": p.headroom,
        "elapsed_s": p.elapsed_s,
        "loss": dataclasses.asdict(p.loss) if p.loss is not None else None,
        "data_host_bytes": p.data_host_bytes,
        "pipeline": pipeline_dict(p),
        **({"grpo": grpo_dict(p)} if p.grpo is not None else {}),  # GRPO plans only
    }
    if p.other is not None:
        out["analytic"] = dataclasses.asdict(p.other)
    return out


def toml_lines(changes: dict[str, object]) -> str:
    """The config lines to set, grouped by section; a value of None means "remove
    this key" (back to its default), written as a comment."""
    return dump_tables(dotted_tables(changes)).rstrip()


def _label(c: Candidate) -> str:
    changes = ", ".join(
        f"{k}={toml_value(v)}" for k, v in c.changes.items() if v is not None
    )  # fmt: skip
    return changes or "your configuration as is"


def _cost(c: Candidate) -> str:
    k = c.cost
    return (
        f"~{k.total_s:.2f} s/step (compute {k.compute_s:.2f} + recompute {k.recompute_s:.2f}, "
        f"comm {k.comm_s:.2f} overlapped"
        + (f", tp/cp exchange {k.exchange_s:.2f}" if k.exchange_s else "")
        + (f", offload {k.offload_s:.2f}" if k.offload_s else "")
        + f"; {_tokens(c.plan.scenario):,} tokens/step)"
    )


def _tokens(sc: Scenario) -> int:
    """Tokens of one optimizer step over all data-parallel ranks."""
    return sc.dims.dp * sc.tokens * sc.grad_accum


def _peak(c: Candidate) -> str:
    m = c.plan.memory
    where = f": {m.peak.where}" if m.peak.where else ""
    return f"peak {fmt_bytes(m.peak.bytes)} at {m.peak.phase}{where}"


def explain(rec: Recommendation) -> list[str]:
    """Why the recommendation is what it is, one sentence per line."""
    usable = rec.current.plan.usable_bytes if rec.current else None
    lines = [f"searched {rec.considered} configurations; {rec.fitting} fit in {fmt_bytes(usable)}."]
    if rec.searched > rec.considered:
        lines[0] = (
            f"searched {rec.searched} configurations, traced {rec.considered} of them cheapest "
            f"first (the model has no analytic plan); {rec.fitting} fit in {fmt_bytes(usable)}."
        )
    if rec.current is not None:
        verdict = "fits" if rec.current.fits else "does not fit"
        lines.append(f"yours {verdict}: {_peak(rec.current)}, {_cost(rec.current)}.")
    if rec.best is None:
        lines.append(
            "nothing fits: more ranks, a shorter sequence or a smaller micro-batch are needed."
        )
    else:
        lines.append(f"pick: {_label(rec.best)} — {_peak(rec.best)}, {_cost(rec.best)}.")
    if rec.cheaper_unfit is not None:
        c = rec.cheaper_unfit
        need = fmt_bytes(c.plan.memory.peak.bytes)
        lines.append(f"faster but does not fit: {_label(c)} ({_cost(c)}) needs {need}.")
    return lines + _layout_lines(rec)


def _chosen_layout(rec: Recommendation) -> str:
    """One sentence: the layout picked and the smaller ones that did not do."""
    assert rec.best is not None
    sc = rec.best.plan.scenario
    chosen = next(t for t in rec.layouts if (t.tp, t.cp) == (sc.dims.tp, sc.dims.cp))
    smaller = [t for t in rec.layouts if t.ranks < chosen.ranks]
    offload = " with CPU offload" if rec.best.config.offload.params else ""
    why = f"layout: {chosen.describe()}{offload}, the fewest model-parallel ranks that fit"
    names = ", ".join(t.describe() for t in smaller)
    if smaller and all(t.fits_offloaded for t in smaller) and not offload:
        return why + f"; smaller ones fit only with CPU offload ({names})."
    if smaller:
        return why + f"; smaller ones do not fit ({names}: below)."
    return why + "."


def _layout_lines(rec: Recommendation) -> list[str]:
    """Why this tp x cp layout ([Note: layout search]): each layout tried, fewest
    model-parallel ranks first, with its closest candidate's peak."""
    if len(rec.layouts) < 2 and not any(t.ranks > 1 for t in rec.layouts):
        return []
    out = [_chosen_layout(rec)] if rec.best is not None else []
    out += ["layouts (fewest model-parallel ranks first, each with its fastest fitting "
            "candidate, else its lowest peak; the first that fits without CPU offload wins, "
            "else the first that fits with it):"]  # fmt: skip
    for t in rec.layouts:
        if t.peak is None or t.usable is None:
            out.append(f"  {t.describe()}: no valid configuration")
            continue
        over = t.peak - t.usable
        verdict = f"fits ({fmt_bytes(-over)} to spare)" if over <= 0 else f"{fmt_bytes(over)} over"
        how = "with CPU offload" if t.changes.get("offload.params") else "without offload"
        if not t.fits_offloaded:
            how = "at best"
        out.append(f"  {t.describe()}: {fmt_bytes(t.peak)} {how}, {verdict}")
    return out


def format_recommendation(rec: Recommendation) -> str:
    lines = ["recommendation:", *[f"  {line}" for line in explain(rec)]]
    if rec.ranked:
        lines.append("ranked (fitting, fastest first):")
        for i, c in enumerate(rec.ranked, 1):
            lines.append(f"  {i}. {_label(c)}: {fmt_bytes(c.plan.memory.peak.bytes)}, {_cost(c)}")
    if rec.best is not None and rec.best.changes:
        lines += ["", "set in your config (TOML):", toml_lines(rec.best.changes)]
    elif rec.best is not None:
        lines += ["", "keep your configuration: it is the fastest that fits."]
    return "\n".join(lines)


def _candidate_dict(c: Candidate | None) -> dict[str, Any] | None:
    if c is None:
        return None
    return {
        "changes": c.changes,
        "peak_bytes": c.plan.memory.peak.bytes,
        "peak_phase": c.plan.memory.peak.phase,
        "peak_where": c.plan.memory.peak.where,
        "fits": c.fits,
        "cost": dataclasses.asdict(c.cost) | {"total_s": c.cost.total_s},
        "toml": toml_lines(c.changes),
    }


def recommendation_dict(rec: Recommendation) -> dict[str, Any]:
    return {
        "best": _candidate_dict(rec.best),
        "ranked": [_candidate_dict(c) for c in rec.ranked],
        "current": _candidate_dict(rec.current),
        "cheaper_unfit": _candidate_dict(rec.cheaper_unfit),
        "considered": rec.considered,
        "searched": rec.searched,
        "fitting": rec.fitting,
        "explanation": explain(rec),
        "layouts": [dataclasses.asdict(t) | {"layout": t.describe()} for t in rec.layouts],
    }
