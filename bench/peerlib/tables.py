"""BENCHMARKS.md's peers block, made from ``bench/results/peers.json`` alone (pure:
tests/unit/test_bench_docs.py renders it again and compares). ``render(results)`` is
bench/peers.py's; the row records are what ``peers.row_record`` wrote."""

from __future__ import annotations

import json
from typing import Any

from peerlib.scaling import STRATEGIES


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio(r: list[float | None] | None) -> str:
    if not r or r[0] is None:
        return "-"
    return f"{r[0]:.3f} ({_f(r[1], '.2f')}-{_f(r[2], '.2f')})"


def _span(r: dict[str, Any]) -> str:
    return "-" if r["low"] is None else f"{r['low']:,.0f}-{r['high']:,.0f}"


def _median(values: list[float]) -> float | None:
    ordered = sorted(values)
    n = len(ordered)
    if not n:
        return None
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def settings_table(rows: list[dict[str, Any]]) -> str:
    """The per-row part of the workload: what each row's optimizer and loss were."""
    lines = [
        "| row | settings | AdamW kernel (as built) | loss | FSDP units |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        group = "defaults" if r["defaults"] else "shared"
        lines.append(
            f"| {r['label']} | {group} | {r['adamw'] or '-'} | {r['loss']} | {r['units']} |"
        )
    return "\n".join(lines)


def speed_table(rows: list[dict[str, Any]], *, twin: bool) -> str:
    """tokens/s, ratios, memory and loss agreement; ``twin`` adds the ratio of a
    defaults row to the same framework at the shared settings."""
    head = (
        "| row | tokens/s median | min-max | vs hand-written A (paired min-max) | "
        + ("vs its shared row (paired min-max) | " if twin else "")
        + "peak MiB/rank | params/rank | max abs loss diff vs DDP | s per launch | verdict |"
    )
    lines = [head, "|" + "---|" * (10 if twin else 9)]
    for r in rows:
        share = f"1/{round(1 / r['shard_fraction'])}" if r["shard_fraction"] else "-"
        peaks = " / ".join(f"{m:.1f}" for m in r["peak_mib"]) or "-"
        lines.append(
            f"| {r['label']} | {_f(r['median'], ',.0f')} | {_span(r)} | {_ratio(r['ratio'])} | "
            + (f"{_ratio(r['vs_shared'])} | " if twin else "")
            + f"{peaks} | {share} | {_f(r['max_loss_diff'], '.1e')} | "
            f"{_f(_median(r['wall_s']), '.0f')} | {r['verdict']} |"
        )
    return "\n".join(lines)


def scaling_table(scale: dict[str, Any]) -> str:
    """Per-rank model state and step peak per strategy at each world size."""
    worlds = sorted(scale, key=int)
    head = (
        "| strategy | "
        + " | ".join(f"N={w} state / peak MiB" for w in worlds)
        + " | state x N (ideal: constant) |"
    )
    lines = [head, "|" + "---|" * (len(worlds) + 2)]
    for strategy in STRATEGIES:
        cells, ideal = [], []
        for w in worlds:
            ranks = scale[w]
            state = max(r[strategy]["model_state"] for r in ranks) / 2**20
            peak = max(r[strategy]["peak"] for r in ranks) / 2**20
            cells.append(f"{state:.1f} / {peak:.1f}")
            ideal.append(f"{state * int(w):.1f}")
        lines.append(f"| {strategy} | " + " | ".join(cells) + f" | {' / '.join(ideal)} |")
    return "\n".join(lines)


def _load(results: dict[str, Any]) -> str:
    loads = results.get("load_1min_per_rep") or []
    if not loads:
        return ""
    return (
        f" The 1-minute load average after each repetition was {min(loads):.1f}-"
        f"{max(loads):.1f} on {results['machine'].split()[-2]} cores, shared with other "
        "sessions' work: read speed ratios against the A/A control; memory and loss do "
        "not depend on load."
    )


def render(results: dict[str, Any], *, provenance: str) -> str:
    """The whole measured section: run line, per-row settings, both speed tables, the
    A/A control, notes, probes and memory scaling."""
    rows = results["rows"]
    shared = [r for r in rows if not r["defaults"]]
    defaults = [r for r in rows if r["defaults"]]
    control = next((r for r in rows if r["key"] == results["control"]), None)
    spec = results["spec"]
    out = [
        provenance,
        "",
        f"{results['reps']} alternating repetitions (ABBA) of every row, {spec['steps']} "
        f"steps per run, tokens/s over steps {spec['warmup'] + 1}-{spec['steps'] - 1} "
        f"(step {spec['steps']} is profiled for memory); {results['minutes']:.1f} min in "
        "all." + _load(results),
        "",
        settings_table(rows),
        "",
        "**At the shared settings** (the same AdamW kernel, loss and units in every row: "
        "the overhead comparison)",
        "",
        speed_table(shared, twin=False),
        "",
        f"A/A control: hand-written B / A = {_ratio(control['ratio'] if control else None)} "
        "(the same script under two names: the noise floor of every ratio here).",
        "",
        "**At each framework's own defaults** (the value of defaults; hyper-parameters as above)",
        "",
        speed_table(defaults, twin=True),
    ]
    notes = [f"- {r['label']}: {r['note']}" for r in rows if r.get("note")]
    if notes:
        out += ["", *notes]
    if results.get("probes"):
        out += ["", "Probes (what each does on CPU as shipped, same run):", "", "```"]
        out += [f"probe {k}: {json.dumps(v)}" for k, v in results["probes"].items()]
        out += ["```"]
    if results.get("scaling"):
        out += ["", "Memory per rank vs world size (fsdpkit, same run):", ""]
        out += [scaling_table(results["scaling"])]
    return "\n".join(out) + "\n"
