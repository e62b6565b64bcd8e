"""Traced pipeline plans ([Note: traced pipeline plans] in fsdpkit.planner.pipeline.traced)
against each pipeline rank's true peak: mixture-of-experts models under pp, ep inside
the stages, and a dense control whose traced ranks must equal its analytic ones
(issue 50 item 6).

    .venv/bin/python bench/plan_pipeline_moe.py [--steps 3]
    .venv/bin/python bench/plan_pipeline_moe.py --render-docs

4 gloo ranks, fp32, 8 micro-batches of 1 x 128 tokens per step (pp2 x dp2 unless the
row says otherwise): the built-in MoE (plan_accuracy's model "E" at 4 blocks, 8
experts, top 2) and transformers' Qwen3-MoE (4 experts, top 2, 3 layers, from a
config-only directory), trained by the trainer's own builder and step
(fsdpkit.planner.traced.measure); per step the max over a stage's ranks, "typical"
the median step ([Note: measuring CPU peaks]). Under ep the plan is made twice: at
balanced routing (the default) and at the run's own recorded routing (each pp rank's
MoE layers at the median step's received rows of the busiest rank of its stage, as
``--moe-imbalance`` feeds a recorded run; at the mean over the step's micro-batches, and
at the largest), and once per step at that step's own routing, every dispatch of the
stage's rank that peaked highest at its recorded load (the replay: what is left is the
plan's, not the router's). Writes bench/results/plan_pipeline_moe.json and renders
docs/planner.md's table from it.
"""

from __future__ import annotations

import statistics
from typing import Any

import results_io
from plan_accuracy_cases import MODELS, hf_dir

from fsdpkit.config import load
from fsdpkit.config.dims import parallel_dims
from fsdpkit.planner import plan
from fsdpkit.planner.experts.routing import Routing
from fsdpkit.planner.shapes.scenario import model_shape
from fsdpkit.planner.traced.measure import measure_step_records
from fsdpkit.testing import run_ranks

NAME = "plan_pipeline_moe"
DOCS = results_io.ROOT / "docs" / "planner.md"
STEP = ["data.seq_len=128", "train.micro_batch_size=1", "train.global_batch_size=8"]
BUILTIN = [
    "model.preset=moe-tiny", "model.dim=128", "model.n_layers=4", "model.experts=8",
    "model.vocab_size=2048", "model.tie_embeddings=false", *STEP,
]  # fmt: skip
DENSE = ["model.preset=tiny", *MODELS["P"]]
PP2, EP2 = "parallel.pp=2", "parallel.ep=2"
ROWS: dict[str, list[str]] = {
    "dense Llama, traced (control)": [*DENSE, PP2],
    "built-in MoE": [*BUILTIN, PP2],
    "built-in MoE, GPipe": [*BUILTIN, PP2, "parallel.pp_schedule=GPipe"],
    "built-in MoE, Interleaved1F1B": [*BUILTIN, PP2, "parallel.pp_schedule=Interleaved1F1B"],
    "built-in MoE, full AC": [*BUILTIN, PP2, "activations.mode=full"],
    "built-in MoE, tied": [*BUILTIN, PP2, "model.tie_embeddings=true"],
    "built-in MoE, pp4": [*BUILTIN, "parallel.pp=4"],
    "built-in MoE, pp2 x ep2": [*BUILTIN, PP2, EP2],
    "Qwen3-MoE": ["QWEN3", *STEP, PP2],
    "Qwen3-MoE, pp2 x ep2": ["QWEN3", *STEP, PP2, EP2],
}
"""Row name -> overrides ("QWEN3": the transformers model's directory)."""


def _config(overrides: list[str]) -> Any:
    qwen = [f"model.hf={hf_dir('qwen3_moe')}"] if "QWEN3" in overrides else []
    return load(None, [*qwen, *(o for o in overrides if o != "QWEN3"), "precision.mode=fp32"])


def _recorded(
    cfg: Any, records: list[dict[str, list[dict[str, Any]]]], name: str, *, key: str
) -> Routing:
    """Each MoE layer at the median step's received rows of the busiest rank of its
    stage (``key``: ``moe_layer_loads``, a rank's own mean over the step's micro-batches,
    or ``moe_layer_peaks``, its largest; its stage's layers in order)."""
    dims = parallel_dims(cfg, world_size=len(records), local_world_size=len(records))
    by_layer: list[float] = []
    for pp_rank in range(dims.pp):
        ranks = [g for g in range(len(records)) if dims.pp_rank(g) == pp_rank]
        loads = [
            [statistics.median(step[key][i] for step in records[g][name]) for g in ranks]
            for i in range(len(records[ranks[0]][name][0][key]))
        ]
        by_layer += [max(layer) for layer in loads]
    return Routing(by_layer=tuple(by_layer), source=f"recorded by the {name} run")


def _replayed(
    cfg: Any, records: list[dict[str, list[dict[str, Any]]]], name: str, *, step: int
) -> tuple[Routing, list[int]]:
    """Step ``step`` replayed: each pp rank's MoE layers at every dispatch's recorded
    load of its stage's rank that peaked highest in that step, and those peaks."""
    dims = parallel_dims(cfg, world_size=len(records), local_world_size=len(records))
    calls: list[tuple[float, ...]] = []
    peaks = []
    for pp_rank in range(dims.pp):
        ranks = [g for g in range(len(records)) if dims.pp_rank(g) == pp_rank]
        top = max(ranks, key=lambda g: records[g][name][step]["peak"])
        calls += [tuple(c) for c in records[top][name][step]["moe_layer_calls"]]
        peaks.append(records[top][name][step]["peak"])
    return Routing(by_call=tuple(calls), source=f"step {step} of the {name} run"), peaks


def measure(steps: int) -> list[dict[str, Any]]:
    configs = {name: _config(extra) for name, extra in ROWS.items()}
    specs = [
        (name, cfg, None if cfg.model.hf else model_shape(cfg)) for name, cfg in configs.items()
    ]
    records = run_ranks(measure_step_records, world_size=4, args=(specs, steps), timeout_s=3600)
    rows = []
    for name, cfg in configs.items():
        dims = parallel_dims(cfg, world_size=4, local_world_size=4)
        plans = {"planned": plan(cfg, world_size=4, trace=True).pipeline}
        if "control" in name:
            plans["analytic"] = plan(cfg, world_size=4).pipeline
        if dims.ep > 1:
            for key, label in (
                ("moe_layer_loads", "at its mean"),
                ("moe_layer_peaks", "at its largest"),
            ):
                routing = _recorded(cfg, records, name, key=key)
                plans[label] = plan(cfg, world_size=4, trace=True, routing=routing).pipeline
        replays = []  # per step: (the replayed plan's pipeline, the real peaks)
        for i in range(steps if dims.ep > 1 else 0):
            routing, real = _replayed(cfg, records, name, step=i)
            replays.append((plan(cfg, world_size=4, trace=True, routing=routing).pipeline, real))
        for pp_rank in range(dims.pp):
            ranks = [g for g in range(4) if dims.pp_rank(g) == pp_rank]
            peaks = [max(records[g][name][i]["peak"] for g in ranks) for i in range(steps)]
            row: dict[str, Any] = {"row": name, "pp_rank": pp_rank, "steps": peaks}
            for key, p in plans.items():
                assert p is not None
                row[key] = p.ranks[pp_rank].memory.peak.bytes
            if replays:
                row["replayed"] = [
                    [p.ranks[pp_rank].memory.peak.bytes, real[pp_rank]]
                    for p, real in replays
                    if p is not None
                ]
            rows.append(row)
    return rows


def _error(planned: int | None, typical: float) -> str:
    return "" if planned is None else f"{(planned - typical) / typical:+.2%}"


def _replay_error(pairs: list[list[int]] | None) -> str:
    """The replayed steps' error farthest from zero (each step against its own peak)."""
    if not pairs:
        return ""
    worst = max(((p - real) / real for p, real in pairs), key=abs)
    return f"{worst:+.2%}"


def render(results: dict[str, Any]) -> str:
    """docs/planner.md's table (tests/unit/test_bench_docs.py checks it)."""
    header = [
        *("pp2 x dp2, 1F1B unless named", "pp rank", "typical", "traced plan", "error"),
        *("at its mean routing", "at its largest", "each step replayed (worst)", "analytic"),
    ]
    return results_io.steps_table(
        results,
        NAME,
        header=header,
        cells=lambda r, typical: [
            r["row"],
            str(r["pp_rank"]),
            f"{typical / 2**20:.2f} MiB",
            f"{r['planned'] / 2**20:.2f} MiB",
            _error(r["planned"], typical),
            _error(r.get("at its mean"), typical),
            _error(r.get("at its largest"), typical),
            _replay_error(r.get("replayed")),
            _error(r.get("analytic"), typical),
        ],
    )


if __name__ == "__main__":
    results_io.steps_main(NAME, doc=DOCS, description=__doc__, measure=measure, render=render)
