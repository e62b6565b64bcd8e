"""Per-rank memory of DPO: a separate frozen reference vs LoRA with adapters off.

    python bench/dpo_memory.py                   # HF Llama d=512, 8 layers, vocab 32000, 2 ranks
    python bench/dpo_memory.py --dim 1024 --vocab 4096  # blocks dominate, not logits
    python bench/dpo_memory.py --render-docs     # only re-render docs/preference.md

Writes a random-weight Hugging Face Llama directory (under --cache) and 64 synthetic
preference pairs, then for each row runs on 2 gloo ranks exactly what
``fsdpkit train train.objective=dpo model.hf=DIR ...`` builds (``build_session``:
policy, reference, optimizer, loader) and measures fsdpkit's training step with the
run's DPO loss (2 pairs = 4 rows x 256 tokens per rank, fp32). Per rank:

- what the built run holds before its first step (parameters of policy and reference),
  and the step's true peak of live CPU tensor memory from c10's allocator with
  process-wide accounting ([Note: measuring CPU peaks] in fsdpkit.cpumem), both minus
  what the process held before building, after a warm-up step (AdamW state exists);
- the analytic planner's predicted peak for the same config ([Note: reference in the
  plan]) and its error;
- the ratio of the peak to the two-model row's.

Memory is exact and repeatable (not a timing), so one run per row suffices; the
"two models (again)" row is a same-vs-same control that must read 1.00. The machine is
shared with other jobs, which changes timings but not these byte counts.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path
from typing import Any

import results_io

from fsdpkit.testing import run_ranks

NAME = "dpo_memory"
DOCS = results_io.ROOT / "docs" / "preference.md"
MIB = 2**20
ROWS: dict[str, list[str]] = {
    "DPO, two models (policy + sharded fp32 reference)": [],
    "DPO, two models (again)": [],
    "DPO, LoRA r=16, adapters off (one model)": ["lora.rank=16"],
    "SimPO, full fine-tune (no reference)": ["dpo.loss=simpo"],
    "DPO, two models, pp2 (1F1B, 2 micro-batches)": ["parallel.pp=2", "train.grad_accum=2"],
    "DPO, LoRA r=16, pp2 (1F1B, 2 micro-batches)": [
        *("parallel.pp=2", "train.grad_accum=2", "lora.rank=16"),
    ],
}
"""The pp2 rows run the same pairs per step through one pipeline of both ranks (pp2 x
dp1): the reference's log-probs in a pass of their own through its stages, then the
schedule ([Note: preference pairs through pipeline stages])."""


def _config(model_dir: str, data: str, run_dir: str, overrides: list[str]) -> list[str]:
    return [
        f"model.hf={model_dir}",
        f"data.path={data}",
        f"logging.run_dir={run_dir}",
        "train.objective=dpo",
        "train.micro_batch_size=2",
        "data.seq_len=256",
        "data.val_fraction=0",
        "precision.mode=fp32",
        "train.chunked_loss=off",
        "logging.progress=none",
        *overrides,
    ]


def _measure(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    from fsdpkit.config import load
    from fsdpkit.cpumem import enable_process_wide_accounting, live_bytes, peak_bytes
    from fsdpkit.runtime.distenv import joined_env
    from fsdpkit.train.session import build_session
    from fsdpkit.trainable.pipeline.preference import reference_pass
    from fsdpkit.trainable.pipeline.step import pipeline_step
    from fsdpkit.trainable.step import train_step

    del rank
    enable_process_wide_accounting()
    base = live_bytes()
    env = joined_env()
    assert env is not None and env.world_size == world
    s = build_session(load(None, overrides), env)
    built = live_bytes() - base

    def step() -> None:
        batches = s.loader.next_step()
        pipe = s.trainable.pipeline
        if pipe is not None:  # what fsdpkit.train.stepping.run_step runs under pp
            reference_pass(pipe, s.trainable.loss_fn, batches)  # type: ignore[arg-type]
            pipeline_step(pipe, s.trainable.model, s.trainable.optimizer, batches, max_norm=1.0)
            return
        train_step(
            s.trainable.model,
            s.trainable.optimizer,
            batches,
            loss_fn=s.trainable.loss_fn,
            max_norm=1.0,
        )

    step()  # AdamW creates its state
    peak = peak_bytes(step) - base
    reference = getattr(s.trainable.loss_fn, "reference", None)
    ref_local = 0
    if reference is not None:
        ref_local = sum(p.to_local().numel() * p.element_size() for p in reference.parameters())
    return {"built": built, "peak": peak, "reference_bytes": ref_local}


def _inputs(cache: Path, dim: int, vocab: int) -> tuple[Path, Path]:
    """The model directory (bench/finetune_memory.py's writer: the same shapes) and the
    pairs file."""
    model_dir = results_io.bench("finetune_memory")._model_dir(str(cache), dim, vocab)
    data = cache / "pairs.jsonl"
    rng = random.Random(0)
    text = "abcdefghij klmnopqrstuvwxyz"
    rows = [
        {
            "prompt": "".join(rng.choice(text) for _ in range(100)),
            "chosen": "".join(rng.choice(text) for _ in range(150)),
            "rejected": "".join(rng.choice(text) for _ in range(140)),
        }
        for _ in range(64)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model_dir, data


def _planned(overrides: list[str], *, world: int) -> list[int]:
    """The planned peak per rank: each pipeline rank's own under pp (here one pipeline
    over the ranks: pp rank = rank), else the one plan every rank has."""
    from fsdpkit.config import load
    from fsdpkit.planner import plan

    made = plan(load(None, overrides), world_size=world, trace=False)
    if made.pipeline is not None:
        return [r.memory.peak.bytes for r in made.pipeline.ranks]
    return [made.memory.peak.bytes] * world


def render(results: dict[str, Any]) -> str:
    """docs/preference.md's table (tests/unit/test_bench_docs.py checks it)."""
    first = results["rows"][0]
    out = [
        results_io.provenance(results, NAME),
        "",
        f"HF Llama d={first['dim']}, vocabulary {first['vocab']}, 8 layers, "
        f"{first['world']} ranks:",
        "",
        "| row | built / rank | reference shards / rank | step peak / rank | planned peak "
        "| plan error | plan error per rank | x two models |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results["rows"]:
        cells = [r["built_bytes"], r["reference_bytes_rank0"], r["step_peak_bytes"]]
        cells += [r["planned_peak_bytes"]]
        mib = " | ".join(f"{c / MIB:.1f} MiB" for c in cells)
        each = " / ".join(f"{100 * e:+.1f}%" for e in r.get("rank_plan_error", []))
        out.append(
            f"| {r['row']} | {mib} | {100 * r['plan_error']:+.1f}% | {each or '-'} "
            f"| {r['x_two_models']:.2f} |"
        )
    out += [
        "",
        "Step peak and planned peak: the highest rank's; per rank: each rank's plan (under "
        "pp its pipeline rank's) against its own peak.",
    ]
    return "\n".join(out) + "\n"


def measure(*, dim: int, vocab: int, world: int, cache: Path) -> list[dict[str, Any]]:
    model_dir, data = _inputs(cache, dim, vocab)
    out: list[dict[str, Any]] = []
    first = None
    for name, extra in ROWS.items():
        with tempfile.TemporaryDirectory(prefix="dpo-bench-") as run_dir:
            overrides = _config(str(model_dir), str(data), run_dir, extra)
            got = run_ranks(_measure, world_size=world, args=(overrides,), timeout_s=900)
            planned = _planned(overrides, world=world)
        peaks = [g["peak"] for g in got]
        peak, top = max(peaks), max(planned)
        first = first or peak
        row = {
            "dim": dim, "vocab": vocab, "world": world, "row": name,
            "built_bytes": max(g["built"] for g in got),
            "reference_bytes_rank0": got[0]["reference_bytes"],
            "step_peak_bytes": peak, "planned_peak_bytes": top,
            "plan_error": round(top / peak - 1, 4), "x_two_models": round(peak / first, 4),
            "rank_peak_bytes": peaks, "rank_planned_bytes": planned,
            "rank_plan_error": [round(p / m - 1, 4) for p, m in zip(planned, peaks)],
        }  # fmt: skip
        print(
            f"{name:<52} built {row['built_bytes'] / MIB:8.1f} MiB  reference "
            f"{row['reference_bytes_rank0'] / MIB:7.1f} MiB  peak {peak / MIB:8.1f} MiB  "
            f"plan {top / MIB:8.1f} MiB ({100 * row['plan_error']:+.1f}%)  "
            f"x {row['x_two_models']:.2f}  per rank {row['rank_plan_error']}",
            flush=True,
        )
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--render-docs", action="store_true", help="only re-render docs/preference.md")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dim", type=int, default=512, help="hidden size")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    p.add_argument("--cache", default="/tmp/fsdpkit-bench-dpo", help="model directory cache")
    args = p.parse_args()
    if not args.render_docs:
        cache = Path(args.cache)
        cache.mkdir(parents=True, exist_ok=True)
        print(f"HF Llama, 8 layers, fp32, {args.world} ranks, 2 pairs x 256 tokens per rank")
        rows = measure(dim=args.dim, vocab=args.vocab, world=args.world, cache=cache)
        results_io.write(NAME, rows=rows)
    results_io.render_into(DOCS, NAME, render(results_io.read(NAME)))


if __name__ == "__main__":
    main()
