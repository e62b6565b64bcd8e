"""The pipeline planner on fine-tuning runs: each pipeline rank's plan against its
true peak (issue 50 item 6), where bench/plan_accuracy.py's rows compare only the
highest rank.

    .venv/bin/python bench/plan_pipeline_finetune.py [--steps 5]
    .venv/bin/python bench/plan_pipeline_finetune.py --render-docs

4 gloo ranks, pp2 x dp2 (1F1B), plan_accuracy's model "P" (a tiny untied Llama, 4
blocks, 8 micro-batches of 1), trained by the trainer's own builder and step
(fsdpkit.planner.traced.measure); per step the max over a stage's ranks, "typical" the
median step ([Note: measuring CPU peaks]). A full fine-tune row is the control (the
tests hold it within 1%). Writes bench/results/plan_pipeline_finetune.json and
renders docs/planner.md's table from it.
"""

from __future__ import annotations

from typing import Any

import results_io
from plan_accuracy_cases import MODELS

from fsdpkit.config import load
from fsdpkit.planner import plan
from fsdpkit.planner.shapes.scenario import model_shape
from fsdpkit.planner.traced.measure import measure_step_peaks, pipeline_rank_peaks
from fsdpkit.testing import run_ranks

NAME = "plan_pipeline_finetune"
DOCS = results_io.ROOT / "docs" / "planner.md"
ROWS = {
    "full (control)": ["parallel.pp=2"],
    "LoRA r8": ["parallel.pp=2", "lora.rank=8"],
    "LoRA r8, ZBVZeroBubble": [
        "parallel.pp=2",
        "lora.rank=8",
        "parallel.pp_schedule=ZBVZeroBubble",
    ],
    "LoRA r8, GPipe": ["parallel.pp=2", "lora.rank=8", "parallel.pp_schedule=GPipe"],
    "LoRA r8, full AC": ["parallel.pp=2", "lora.rank=8", "activations.mode=full"],
    "blocks 0-1 frozen": ["parallel.pp=2", 'model.freeze=["model.layers.[0-1].*"]'],
    "offload.params": ["parallel.pp=2", "offload.params=true"],
}
BASE = ["model.preset=tiny", *MODELS["P"], "precision.mode=fp32"]


def measure(steps: int) -> list[dict[str, Any]]:
    configs = {name: load(None, [*BASE, *extra]) for name, extra in ROWS.items()}
    specs = [(name, cfg, model_shape(cfg)) for name, cfg in configs.items()]
    per_rank = run_ranks(measure_step_peaks, world_size=4, args=(specs, steps), timeout_s=1800)
    rows = []
    for name, cfg in configs.items():
        pipe = plan(cfg, world_size=4).pipeline
        assert pipe is not None
        peaks = pipeline_rank_peaks(per_rank, name, cfg=cfg)
        for r in pipe.ranks:
            row = {"row": name, "pp_rank": r.rank, "planned": r.memory.peak.bytes}
            rows.append({**row, "steps": peaks[r.rank]})
    return rows


def render(results: dict[str, Any]) -> str:
    """docs/planner.md's table (tests/unit/test_bench_docs.py checks it)."""
    return results_io.steps_table(
        results,
        NAME,
        header=["pp2 x dp2 (1F1B unless named)", "pp rank", "planned", "typical", "error"],
        cells=lambda r, typical: [
            r["row"],
            str(r["pp_rank"]),
            f"{r['planned'] / 2**20:.2f} MiB",
            f"{typical / 2**20:.2f} MiB",
            f"{(r['planned'] - typical) / typical:+.1%}",
        ],
    )


if __name__ == "__main__":
    results_io.steps_main(NAME, doc=DOCS, description=__doc__, measure=measure, render=render)
