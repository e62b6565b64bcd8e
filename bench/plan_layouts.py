"""Plans of issue 23 with tensor and context parallelism and of issue 38 with pipeline
parallelism: FSDP alone against the layout ``fsdpkit plan --recommend`` picks, and
torchtitan's published memory for the same shapes; and of issue 37: the two
mixture-of-experts presets with and without expert parallelism.

    .venv/bin/python bench/plan_layouts.py                  # the whole table (~1 h: MoE traced)
    .venv/bin/python bench/plan_layouts.py --render-docs    # docs/planner.md's tables

Every row is ``fsdpkit plan`` (the analytic planner: nothing runs on a device) with
bf16, full activation checkpointing and micro-batch 1 on H100s (``--device-mem h100``:
80 GiB, 70.29 GiB usable after the runtime reserve and the 10% margin), the chunked loss
(the default) unless the row says otherwise. "recommended" rows run ``recommend()`` and
plan its pick. torchtitan's figures are quoted from its published benchmark
(``benchmarks/llama3_h100_202412_torchtitan.md``, torchtitan 9dec370, 2024-12: 96 GB
H100s, max reserved memory, torch.compile and Float8 on, ring-attention CP, full
logits); they are published numbers, not measured here.
Writes bench/results/plan_layouts.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import results_io

from fsdpkit.config import load, with_changes
from fsdpkit.config.toml import toml_value
from fsdpkit.devices import parse_device
from fsdpkit.planner import plan, recommend

NAME = "plan_layouts"
PP405 = [
    "model.preset=llama3-405b", "data.seq_len=8192", "parallel.tp=8", "parallel.pp=8",
    "parallel.pp_split=params", "train.global_batch_size=256",
]  # fmt: skip
BIG_BATCH = ["model.preset=llama3-405b", "data.seq_len=8192", "train.global_batch_size=512"]
ISSUE = ["precision.mode=bf16", "activations.mode=full", "train.micro_batch_size=1"]
TORCHTITAN = "benchmarks/llama3_h100_202412_torchtitan.md"

ROWS: list[tuple[str, list[str], int, str | None]] = [
    # (label, overrides, world size, torchtitan's published GiB for the same shape)
    ("llama3-70b 32768: FSDP only", ["model.preset=llama3-70b", "data.seq_len=32768"], 8, None),
    ("llama3-70b 32768: FSDP + CPU offload",
     ["model.preset=llama3-70b", "data.seq_len=32768", "offload.params=true"], 8, None),
    ("llama3-70b 32768: cp 2 + CPU offload",
     ["model.preset=llama3-70b", "data.seq_len=32768", "offload.params=true", "parallel.cp=2"],
     8, None),
    ("llama3-70b 32768: tp 8 (no offload)",
     ["model.preset=llama3-70b", "data.seq_len=32768", "parallel.tp=8"], 8, None),
    ("llama3-8b 131072: FSDP only", ["model.preset=llama3-8b", "data.seq_len=131072"], 8, None),
    ("llama3-8b 131072: tp 2", ["model.preset=llama3-8b", "data.seq_len=131072",
                                 "parallel.tp=2"], 8, None),
    ("llama3-8b 131072: FSDP 2 x cp 4 (torchtitan's layout)",
     ["model.preset=llama3-8b", "data.seq_len=131072", "parallel.cp=4"], 8, "84.0 (Table 2)"),
    ("llama3-8b 131072: FSDP 2 x cp 4, full logits",
     ["model.preset=llama3-8b", "data.seq_len=131072", "parallel.cp=4",
      "train.chunked_loss=off"], 8, "84.0 (Table 2)"),
    ("llama3-8b 32768: FSDP 8, full logits",
     ["model.preset=llama3-8b", "data.seq_len=32768", "train.chunked_loss=off"], 8,
     "83.9 (Table 2)"),
    ("llama3-8b 65536: FSDP 4 x cp 2, full logits",
     ["model.preset=llama3-8b", "data.seq_len=65536", "parallel.cp=2", "train.chunked_loss=off"],
     8, "84.2 (Table 2)"),
    ("llama3-405b 8192: FSDP only", ["model.preset=llama3-405b", "data.seq_len=8192"], 512, None),
    ("llama3-405b 8192: tp 8", ["model.preset=llama3-405b", "data.seq_len=8192",
                                "parallel.tp=8"], 512, None),
    ("llama3-70b 8192 x 16: FSDP 32 x tp 8 (torchtitan's 2D run)",
     ["model.preset=llama3-70b", "data.seq_len=8192", "train.micro_batch_size=16",
      "parallel.tp=8"], 256, "71.9 (Table 4)"),
    # issue 38: torchtitan's 3D run, FSDP 8 x tp 8 x pp 8, global batch 256 (32 micro-batches
    # of 1 per data-parallel rank); 126 blocks do not split into 8 equal stages
    ("llama3-405b 8192: FSDP 8 x tp 8 x pp 8, 1F1B (torchtitan's 3D run)",
     [*PP405, "parallel.pp_schedule=1F1B"], 512, "82.5 (Table 5)"),
    ("llama3-405b 8192: FSDP 8 x tp 8 x pp 8, Interleaved1F1B (torchtitan's 3D run)",
     [*PP405, "parallel.pp_schedule=Interleaved1F1B"], 512, "72.7 (Table 5)"),
]  # fmt: skip
RECOMMENDED = [
    ("llama3-70b 32768: recommended", ["model.preset=llama3-70b", "data.seq_len=32768"], 8, None),
    ("llama3-8b 131072: recommended", ["model.preset=llama3-8b", "data.seq_len=131072"], 8, None),
    ("llama3-405b 8192: recommended", ["model.preset=llama3-405b", "data.seq_len=8192"], 512, None),
    # issue 38: a global batch pipelines can split into micro-batches; the network between
    # nodes at h100's 400 Gb/s per GPU, and at 50 Gb/s Ethernet per GPU
    ("llama3-405b 8192, 512 sequences a step: recommended",
     [*BIG_BATCH], 512, None),
    ("llama3-405b 8192, 512 sequences a step, 50 Gb/s per GPU between nodes: recommended",
     [*BIG_BATCH], 512, 6.25),
]  # fmt: skip
MOE = ["data.seq_len=4096", "train.global_batch_size={gbs}", "train.micro_batch_size=4"]
MOE_ROWS: list[tuple[str, list[str], int]] = [
    # (label, overrides, world size): traced plans (the analytic block model is dense)
    ("qwen3-30b-a3b 4096: FSDP only", ["model.preset=qwen3-30b-a3b"], 64),
    ("qwen3-30b-a3b 4096: ep 8", ["model.preset=qwen3-30b-a3b", "parallel.ep=8"], 64),
    ("qwen3-30b-a3b 4096: FSDP only", ["model.preset=qwen3-30b-a3b"], 256),
    ("qwen3-30b-a3b 4096: ep 8", ["model.preset=qwen3-30b-a3b", "parallel.ep=8"], 256),
    ("qwen3-235b-a22b 4096: FSDP only", ["model.preset=qwen3-235b-a22b"], 64),
    ("qwen3-235b-a22b 4096: ep 8", ["model.preset=qwen3-235b-a22b", "parallel.ep=8"], 64),
    ("qwen3-235b-a22b 4096: FSDP only", ["model.preset=qwen3-235b-a22b"], 256),
    ("qwen3-235b-a22b 4096: ep 8", ["model.preset=qwen3-235b-a22b", "parallel.ep=8"], 256),
]
MOE_RECOMMENDED = [
    ("qwen3-30b-a3b 4096: recommended", ["model.preset=qwen3-30b-a3b"], 64),
    ("qwen3-235b-a22b 4096: recommended", ["model.preset=qwen3-235b-a22b"], 256),
]
"""MoE rows: bf16, full AC as the others, seq 4096, 4 sequences per rank in one
micro-batch (train.global_batch_size = 4 x ranks; at micro-batch 1 the run would
accumulate 4 micro-batches, holding an unsharded gradient of the whole model between
them): the recommender may trade checkpointing and micro-batch for memory within that
batch."""
GiB = 2**30


def _moe(overrides: list[str], world: int) -> list[str]:
    return [*(m.format(gbs=4 * world) for m in MOE), *overrides]


def _row(label: str, overrides: list[str], world: int, published: str | None) -> dict[str, Any]:
    cfg = load(None, [*ISSUE, *overrides])
    started = time.perf_counter()
    p = plan(cfg, world_size=world, device=parse_device("h100"))
    peak = p.memory.peak
    return {
        "label": label,
        "command": " ".join([*ISSUE, *overrides]) + f" --world-size {world}",
        "peak_gib": round(peak.bytes / GiB, 2),
        "fits": p.fits,
        "headroom_gib": round((p.headroom or 0) / GiB, 2),
        "where": f"{peak.phase}: {peak.where}",
        "states_gib": round(sum(p.memory.model_states.values()) / GiB, 2),
        "states_on": "host" if p.memory.host_bytes else "device",
        "activations_gib": round(peak.breakdown.get("activations", 0) / GiB, 2),
        "exchange_gib": round(peak.breakdown.get("exchange_buffers", 0) / GiB, 2),
        "tp_cp_traffic_gib": round((p.comm.tp_exchange + p.comm.cp_exchange) / GiB, 1),
        "torchtitan_gib": published,
        "pipeline": _pipeline(p),
    } | _moe_fields(p, seconds=time.perf_counter() - started)


def _moe_fields(p: Any, *, seconds: float) -> dict[str, Any]:
    """What an MoE row adds: the plan's mode and time, the gathered and dispatched bytes."""
    if p.scenario.experts is None:
        return {}
    return {
        "moe": True,
        "mode": p.memory.mode,
        "plan_s": round(seconds, 1),
        "all_gather_gib": round(p.comm.all_gather / GiB, 1),
        "ep_traffic_gib": round(p.comm.ep_exchange / GiB, 1),
        "layout": f"{p.scenario.strategy}, ep {p.scenario.dims.ep}, "
        f"{p.scenario.ac_mode} AC, micro-batch {p.scenario.micro_batch} x accumulation "
        f"{p.scenario.grad_accum}",
    }


def _pipeline(p: Any) -> str | None:
    """A pipelined plan's schedule, bubble and p2p traffic ([Note: pipeline plans])."""
    pipe = p.pipeline
    if pipe is None:
        return None
    return (
        f"{pipe.schedule}, {pipe.micro_batches} micro-batches: bubble {pipe.bubble:.0%}, "
        f"p2p {pipe.p2p_bytes / GiB:.1f} GiB/step, highest peak on pp rank {pipe.worst.rank}"
    )


def _recommended(
    label: str, overrides: list[str], world: int, inter_gbps: float | None
) -> dict[str, Any]:
    cfg = load(None, [*ISSUE, *overrides])
    device = parse_device("h100")
    if inter_gbps is not None:  # a slower network between nodes than h100's default
        device = dataclasses.replace(device, inter_gbps=inter_gbps)
    started = time.perf_counter()
    rec = recommend(cfg, world_size=world, device=device)
    seconds = time.perf_counter() - started
    assert rec.best is not None, label
    changes = {k: v for k, v in rec.best.changes.items() if v is not None}
    row = _row(
        label, [*overrides, *(f"{k}={toml_value(v)}" for k, v in changes.items())], world, None
    )
    tried = [
        f"{t.describe()} {t.peak / GiB:.2f} GiB"
        + (" (offload)" if t.changes.get("offload.params") else "")
        for t in rec.layouts
        if t.peak is not None
    ]
    with_changes(cfg, changes, source="bench")  # the pick is a valid config
    extra = {"recommend_s": round(seconds, 1), "considered": rec.considered} if "moe" in row else {}
    return row | {"changes": changes, "layouts_tried": tried} | extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--render-docs", action="store_true", help="only re-render the docs")
    args = parser.parse_args()
    if not args.render_docs:
        moe = [_row(label, _moe(o, w), w, None) for label, o, w in MOE_ROWS]
        moe += [_recommended(label, _moe(o, w), w, None) for label, o, w in MOE_RECOMMENDED]
        rows = [_row(*r) for r in ROWS] + [_recommended(*r) for r in RECOMMENDED] + moe
        results_io.write(NAME, rows=rows, torchtitan_source=TORCHTITAN)
    render_docs()


DOCS = results_io.ROOT / "docs" / "planner.md"


def render(results: dict[str, Any]) -> str:
    """The docs table of a results file (docs/planner.md holds exactly this between the
    markers; tests/unit/test_bench_docs.py checks it)."""
    head = (
        results_io.provenance(results, NAME) + "\n\n"
        "| plan (bf16, full AC, micro-batch 1, h100) | ranks | peak | verdict | model states "
        "| kept activations at the peak | tp/cp traffic per step | torchtitan published, GiB |\n"
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |\n"
    )
    lines = []
    for r in (r for r in results["rows"] if not r.get("moe")):
        world = r["command"].rsplit(" ", 1)[-1]
        verdict = f"fits ({r['headroom_gib']:.2f} spare)" if r["fits"] else (
            f"{-r['headroom_gib']:.2f} GiB over"
        )  # fmt: skip
        label = r["label"]
        if r.get("pipeline"):
            label += f" ({r['pipeline']})"
        if "changes" in r:
            label += ": " + ", ".join(f"`{k}={toml_value(v)}`" for k, v in r["changes"].items())
        lines.append(
            f"| {label} | {world} | {r['peak_gib']:.2f} GiB | {verdict} | "
            f"{r['states_gib']:.2f} GiB ({r['states_on']}) | {r['activations_gib']:.2f} GiB | "
            f"{r['tp_cp_traffic_gib']:.1f} GiB | {r['torchtitan_gib'] or ''} |"
        )
    tried = "\n".join(
        f"- {r['label']}: " + "; ".join(r["layouts_tried"])
        for r in results["rows"]
        if "layouts_tried" in r and not r.get("moe")
    )
    return (
        head + "\n".join(lines) + "\n\nLayouts the recommender planned, fewest model-parallel "
        "ranks first (each with its fastest fitting candidate, else its lowest peak):\n\n"
        + tried
        + "\n"
        + render_moe(results)
    )


def render_moe(results: dict[str, Any]) -> str:
    """The mixture-of-experts rows (issue 37): traced plans with and without ep."""
    rows = [r for r in results["rows"] if r.get("moe")]
    if not rows:
        return ""
    lines = [
        "\nMixture-of-experts presets (issue 37; traced plans, seq 4096, 4 sequences per "
        "rank, bf16, h100):\n",
        "| plan | ranks | peak | verdict | model states | all-gather per step "
        "| expert dispatch per step | layout | planned in |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | --- | ---: |",
    ]
    for r in rows:
        world = r["command"].rsplit(" ", 1)[-1]
        verdict = f"fits ({r['headroom_gib']:.2f} spare)" if r["fits"] else (
            f"{-r['headroom_gib']:.2f} GiB over"
        )  # fmt: skip
        label = r["label"]
        if "changes" in r:
            label += ": " + ", ".join(f"`{k}={toml_value(v)}`" for k, v in r["changes"].items())
        took = r.get("recommend_s", r["plan_s"])
        lines.append(
            f"| {label} | {world} | {r['peak_gib']:.2f} GiB | {verdict} | "
            f"{r['states_gib']:.2f} GiB | {r['all_gather_gib']:.1f} GiB | "
            f"{r['ep_traffic_gib']:.1f} GiB | {r['layout']} | {took:.0f} s |"
        )
    return "\n".join(lines) + "\n"


def render_docs() -> None:
    """Rewrite docs/planner.md's layout table from the results file."""
    results_io.render_into(DOCS, NAME, render(results_io.read(NAME)))


if __name__ == "__main__":
    main()
