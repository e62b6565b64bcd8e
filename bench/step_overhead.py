"""fsdpkit.shard vs a minimal hand-written FSDP2 setup: time per training step.

    .venv/bin/python bench/step_overhead.py [--steps 30] [--reps 6]

Both models are the same Llama shape with the same settings (full shard, fp32, AdamW,
one FSDP unit per decoder layer + root), built in the same 2-rank CPU run and timed in
alternating blocks, so machine noise hits both alike. A same-vs-same control row (two
hand-written copies) shows the noise floor. Prints a table; ratio = hand / fsdpkit
time (>= 1 means fsdpkit is as fast or faster). Writes
``bench/results/step_overhead.json`` and renders docs/benchmarks.md's table from it
(``--render-docs`` only re-renders).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import results_io
import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from fsdpkit import RunConfig, build_mesh, clip_grad_norm, init_weights, shard
from fsdpkit.models.llama import Llama, preset
from fsdpkit.testing import run_ranks

NAME = "step_overhead"
DOCS = results_io.ROOT / "docs" / "benchmarks.md"
LABELS = {
    "hand": "hand-written FSDP2",
    "hand-2": "hand-written (control)",
    "fsdpkit": "fsdpkit.shard",
}

SHAPE = preset("tiny", n_layers=4, dim=256, ffn_dim=688, max_seq_len=256)
SEQ, BATCH = 256, 4


def _hand_written(mesh: object) -> Llama:
    model = Llama(SHAPE)
    init_weights(model, seed=0)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdpkit(mesh: object) -> Llama:
    with torch.device("meta"):
        model = Llama(SHAPE)
    shard(model, RunConfig(), mesh=mesh)
    return model


def _step(model: Llama, opt: torch.optim.Optimizer, tokens: torch.Tensor, *, kit: bool) -> None:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    if kit:
        clip_grad_norm(model, 1.0)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        float(norm.full_tensor())  # both loops read the norm back for logging
    opt.step()
    opt.zero_grad(set_to_none=True)


def _bench(rank: int, world: int, steps: int, reps: int) -> dict[str, list[float]]:
    mesh = build_mesh(device_type="cpu")
    models = {"fsdpkit": _fsdpkit(mesh), "hand": _hand_written(mesh), "hand-2": _hand_written(mesh)}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True) for k, m in models.items()}
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, SHAPE.vocab_size, (BATCH, SEQ + 1), generator=gen)
    times: dict[str, list[float]] = {k: [] for k in models}
    for name in models:  # warm-up
        for _ in range(2):
            _step(models[name], opts[name], tokens, kit=name == "fsdpkit")
    for _ in range(reps):
        for name in models:
            t0 = time.perf_counter()
            for _ in range(steps):
                _step(models[name], opts[name], tokens, kit=name == "fsdpkit")
            times[name].append((time.perf_counter() - t0) / steps)
    return times


def render(results: dict[str, Any]) -> str:
    """docs/benchmarks.md's table (tests/unit/test_bench_docs.py checks it)."""
    lines = [
        results_io.provenance(results, NAME),
        "",
        f"Llama {results['params_m']:.1f}M params, seq {SEQ}, batch {BATCH}/rank, 2 CPU ranks x "
        f"1 thread, fp32, {results['reps']} alternating blocks of {results['steps']} steps; "
        "ratio = hand-written s/step over the row's (>= 1: as fast or faster).",
        "",
        "| variant | s/step (median) | min | max | ratio hand/x |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['variant']} | {r['median_s']:.4f} | {r['min_s']:.4f} | {r['max_s']:.4f} | "
            f"{r['ratio']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def render_docs() -> None:
    results_io.render_into(DOCS, NAME, render(results_io.read(NAME)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per timed block")
    parser.add_argument("--reps", type=int, default=6, help="alternating blocks per variant")
    parser.add_argument(
        "--render-docs", action="store_true", help="only re-render docs/benchmarks.md's table"
    )
    args = parser.parse_args()
    if args.render_docs:
        render_docs()
        return
    times = run_ranks(_bench, world_size=2, args=(args.steps, args.reps), timeout_s=3600)[0]
    base = statistics.median(times["hand"])
    rows = []
    for name, label in LABELS.items():
        t = times[name]
        med = statistics.median(t)
        rows.append(
            {
                "variant": label,
                "median_s": round(med, 4),
                "min_s": round(min(t), 4),
                "max_s": round(max(t), 4),
                "ratio": round(base / med, 3),
                "times_s": [round(x, 4) for x in t],
            }
        )
        print(rows[-1])
    results_io.write(
        NAME,
        params_m=round(SHAPE.num_params() / 1e6, 2),
        steps=args.steps,
        reps=args.reps,
        rows=rows,
    )
    render_docs()


if __name__ == "__main__":
    main()
