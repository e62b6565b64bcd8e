"""The planner on fine-tuning runs without pp (LoRA, ``model.freeze``): analytic and
traced plans against the true peak of 2 gloo ranks (docs/planner.md's "Fine-tuning
runs" table; bench/plan_pipeline_finetune.py does the pipelined ones).

    .venv/bin/python bench/plan_finetune.py [--steps 5]
    .venv/bin/python bench/plan_finetune.py --render-docs

Each row is trained by the trainer's own builder and step
(fsdpkit.planner.traced.measure) on the tiny built-in Llama (d=256, 4 layers, V=2048,
4 x 128 tokens per rank, fp32) or, for the bf16 row, a smaller one (d=128, 2 layers,
2 x 64 tokens); per step the max over the ranks, "typical" the median step ([Note:
measuring CPU peaks]). The full-training row is the control. Writes
bench/results/plan_finetune.json and renders docs/planner.md's table from it.
"""

from __future__ import annotations

from typing import Any

import results_io

from fsdpkit.config import load
from fsdpkit.planner import plan
from fsdpkit.planner.shapes.scenario import model_shape
from fsdpkit.planner.traced.measure import measure_step_peaks
from fsdpkit.testing import run_ranks

NAME = "plan_finetune"
DOCS = results_io.ROOT / "docs" / "planner.md"
BASE = [
    *("model.preset=tiny", "model.vocab_size=2048", "data.seq_len=128"),
    *("train.micro_batch_size=4", "precision.mode=fp32"),
]
SMALL = [
    *("model.preset=tiny", "model.dim=128", "model.n_layers=2", "model.n_heads=4"),
    *("model.n_kv_heads=2", "model.ffn_dim=344", "model.vocab_size=1024"),
    *("data.seq_len=64", "train.micro_batch_size=2", "precision.mode=bf16"),
]
FROZEN_LEAD = 'model.freeze=["model.embed_tokens.*","model.layers.[0-1].*"]'
FROZEN_MID = 'model.freeze=["model.layers.[0-1].*"]'
ROWS = {
    "full training (control)": BASE,
    "LoRA r=8, all linear": [*BASE, "lora.rank=8"],
    "LoRA r=8 + full activation checkpointing": [*BASE, "lora.rank=8", "activations.mode=full"],
    "frozen embedding + blocks 0-1 (run before anything trainable)": [*BASE, FROZEN_LEAD],
    "the same + activation checkpointing": [*BASE, FROZEN_LEAD, "activations.mode=full"],
    "frozen embedding": [*BASE, 'model.freeze=["model.embed_tokens.*"]'],
    "frozen blocks 0-1, trainable embedding": [*BASE, FROZEN_MID],
    "frozen blocks 0-1, trainable embedding + activation checkpointing": [
        *(*BASE, FROZEN_MID, "activations.mode=full"),
    ],
    "LoRA r=8, bf16 (base stored in bf16; d=128, 2 layers)": [*SMALL, "lora.rank=8"],
    "frozen block 0, bf16 (d=128, 2 layers)": [*SMALL, 'model.freeze=["model.layers.0.*"]'],
}
WORLD = 2


def measure(steps: int) -> list[dict[str, Any]]:
    configs = {name: load(None, overrides) for name, overrides in ROWS.items()}
    specs = [(name, cfg, model_shape(cfg)) for name, cfg in configs.items()]
    per_rank = run_ranks(measure_step_peaks, world_size=WORLD, args=(specs, steps), timeout_s=1800)
    rows = []
    for name, cfg in configs.items():
        analytic = plan(cfg, world_size=WORLD).memory.peak.bytes
        traced = plan(cfg, world_size=WORLD, trace=True).memory.peak.bytes
        measured = [max(rank[name][i] for rank in per_rank) for i in range(steps)]
        rows.append({"row": name, "analytic": analytic, "traced": traced, "steps": measured})
    return rows


def _error(planned: int, truth: float) -> str:
    error = (planned - truth) / truth
    text = f"{error:+.1%}"
    return f"**{text}**" if abs(error) > 0.05 else text


def render(results: dict[str, Any]) -> str:
    """docs/planner.md's table (tests/unit/test_bench_docs.py checks it)."""
    header = [
        "configuration (tiny Llama, d=256, 4 layers, V=2048, 4 x 128 tokens, fp32)",
        *("typical", "analytic", "traced"),
    ]
    return results_io.steps_table(
        results,
        NAME,
        header=header,
        cells=lambda r, typical: [
            r["row"],
            f"{typical / 2**20:.2f} MiB",
            _error(r["analytic"], typical),
            _error(r["traced"], typical),
        ],
    )


if __name__ == "__main__":
    results_io.steps_main(NAME, doc=DOCS, description=__doc__, measure=measure, render=render)
