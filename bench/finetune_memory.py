"""Per-rank memory of LoRA and frozen-weight fine-tuning against a full fine-tune.

    python bench/finetune_memory.py                     # HF Llama d=512, 8 layers, vocab 32000
    python bench/finetune_memory.py --world 2 4 --rank 8 64
    python bench/finetune_memory.py --dim 1024 --vocab 4096  # blocks dominate, not embeddings
    python bench/finetune_memory.py --render-docs            # only re-render docs/finetune.md

Writes a random-weight Hugging Face Llama directory once (under --cache), then for each
row runs on N gloo ranks what ``fsdpkit train model.hf=DIR ...`` does: build on meta,
``[lora]`` / ``model.freeze`` (fsdpkit.finetune.prepare_model), shard, read each rank's slices,
build fsdpkit's AdamW, one warm-up step, then one measured step of fsdpkit's training
step (batch 2 x 256 tokens per rank, fp32). Per rank it reports:

- trainable elements this rank holds, and the optimizer state bytes measured from the
  optimizer itself (AdamW's exp_avg + exp_avg_sq: 8 bytes per trainable element);
- the step's true peak of live CPU tensor memory, from c10's allocator with
  process-wide accounting ([Note: measuring CPU peaks] in fsdpkit.cpumem),
  minus what the process held before the model was built;
- the ratio of that peak to the full fine-tune's at the same world size.

Memory is exact and repeatable here (not a timing), so one run per row suffices; the
"full (again)" row is a same-vs-same control that must read 1.00. Each ``--dim`` is paired
with the ``--vocab`` at the same position (by default both shapes of docs/finetune.md's
table: d=512 with vocabulary 32000, embeddings a large share; d=1024 with 4096, blocks
dominate); every row goes to ``bench/results/finetune_memory.json`` and docs/finetune.md's
table is rendered from it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # tiny_hf

import results_io

from fsdpkit.testing import run_ranks

NAME = "finetune_memory"
DOCS = results_io.ROOT / "docs" / "finetune.md"

ROWS: dict[str, list[str]] = {
    "full fine-tune": [],
    "full (again)": [],
    "freeze embeddings + head": ['model.freeze=["embed_tokens.*","lm_head.*"]'],
    "freeze all but last block": [
        'model.freeze=["embed_tokens.*","lm_head.*","model.norm.*","model.layers.[0-6].*"]'
    ],
    "LoRA r={r}, all linear": ["lora.rank={r}"],
    "LoRA r={r}, q/v only": ["lora.rank={r}", 'lora.targets=["q_proj","v_proj"]'],
}
MIB = 2**20


def _measure(
    rank: int, world: int, model_dir: str, overrides: list[str], vocab: int
) -> dict[str, Any]:
    import torch

    from fsdpkit import build_mesh, shard
    from fsdpkit.config import load
    from fsdpkit.cpumem import enable_process_wide_accounting, live_bytes, peak_bytes
    from fsdpkit.finetune import prepare
    from fsdpkit.loss.contract import next_token_loss
    from fsdpkit.models.factory import build_model
    from fsdpkit.precision import PRESETS
    from fsdpkit.trainable.optim import build_optimizer
    from fsdpkit.trainable.step import train_step

    enable_process_wide_accounting()
    base = live_bytes()
    cfg = load(None, [f"model.hf={model_dir}", "data.seq_len=256", *overrides])
    built = build_model(cfg.model, vocab_size=vocab, seq_len=256, seed=0)
    ft = prepare(built.module, cfg, precision=PRESETS["fp32"], init=built.init)
    model = built.module
    shard(model, cfg, mesh=build_mesh(), init=ft.init)
    opt = build_optimizer(model, cfg.train)
    gen = torch.Generator().manual_seed(rank)
    batch = [torch.randint(0, vocab, (2, 257), generator=gen)]

    def step() -> None:
        train_step(model, opt, batch, loss_fn=next_token_loss, max_norm=1.0)

    step()  # AdamW creates its state
    peak = peak_bytes(step) - base
    local = [p.to_local() for p in model.parameters() if p.requires_grad]  # type: ignore[operator]
    moments = sum(
        s[k].to_local().numel() * s[k].element_size()
        for s in opt.state.values()
        for k in ("exp_avg", "exp_avg_sq")
    )
    return {
        "trainable": sum(t.numel() for t in local),
        "total": ft.counts.total,
        "optimizer_bytes": moments,
        "peak": peak,
    }


def _model_dir(cache: str, dim: int, vocab: int) -> Path:
    model_dir = Path(cache) / f"llama-d{dim}-v{vocab}-l8"
    if not (model_dir / "config.json").is_file():
        from tiny_hf import write_tiny_model

        write_tiny_model(
            model_dir, arch="llama", vocab_size=vocab, dim=dim, layers=8, heads=8,
            kv_heads=4, ffn=dim * 11 // 4, tokenizer=False,
        )  # fmt: skip
    return model_dir


def _measure_shape(
    model_dir: Path, *, dim: int, vocab: int, world: int, rows: list[tuple[str, list[str]]]
) -> list[dict[str, Any]]:
    """Every row at one model shape and world size; peaks relative to the first row."""
    out: list[dict[str, Any]] = []
    full = None
    for name, overrides in rows:
        job = (str(model_dir), overrides, vocab)
        got = run_ranks(_measure, world_size=world, args=job, timeout_s=900)
        peak = max(g["peak"] for g in got)
        full = full or peak
        g = got[0]
        row = {
            "dim": dim, "vocab": vocab, "world": world, "row": name,
            "params": g["total"], "trainable_rank0": g["trainable"],
            "trainable_share": sum(x["trainable"] for x in got) / g["total"],
            "optimizer_bytes_rank0": g["optimizer_bytes"],
            "optimizer_8b_per_elem": all(x["optimizer_bytes"] == 8 * x["trainable"] for x in got),
            "step_peak_bytes": peak, "x_full": round(peak / full, 4),
        }  # fmt: skip
        print(
            f"{world:>5} d={dim:<5} {name:<28} {g['trainable']:>12,} "
            f"{100 * row['trainable_share']:>7.2f}% {g['optimizer_bytes'] / MIB:>9.2f} MiB "
            f"{'yes' if row['optimizer_8b_per_elem'] else 'NO':>4} {peak / MIB:>9.1f} MiB "
            f"{peak / full:>6.2f}",
            flush=True,
        )
        out.append(row)
    return out


def render(results: dict[str, Any]) -> str:
    """docs/finetune.md's table (tests/unit/test_bench_docs.py checks it)."""
    lines = [
        results_io.provenance(results, NAME),
        "",
        "| model | ranks | row | trainable / rank | of total | AdamW state / rank | "
        "= 8 B x trainable | step peak / rank | x full |",
        "| --- | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    shown = None
    for r in results["rows"]:
        key = (r["dim"], r["vocab"], r["world"])
        model = f"d={r['dim']}, V={r['vocab']} ({r['params'] / 1e6:.1f}M)" if key != shown else ""
        shown = key
        lines.append(
            f"| {model} | {r['world']} | {r['row']} | {r['trainable_rank0']:,} | "
            f"{100 * r['trainable_share']:.2f}% | {r['optimizer_bytes_rank0'] / MIB:.2f} MiB | "
            f"{'yes' if r['optimizer_8b_per_elem'] else 'NO'} | "
            f"{r['step_peak_bytes'] / MIB:.1f} MiB | {r['x_full']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def render_docs() -> None:
    results_io.render_into(DOCS, NAME, render(results_io.read(NAME)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world", type=int, nargs="+", default=[2])
    p.add_argument("--rank", type=int, nargs="+", default=[16], help="LoRA ranks to measure")
    p.add_argument("--dim", type=int, nargs="+", default=[512, 1024], help="hidden sizes")
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 4096], help="one per --dim")
    p.add_argument("--cache", default="/tmp/fsdpkit-bench-finetune", help="model directory cache")
    p.add_argument("--render-docs", action="store_true", help="only re-render docs/finetune.md")
    args = p.parse_args()
    if args.render_docs:
        render_docs()
        return
    if len(args.dim) != len(args.vocab):
        p.error(f"--dim has {len(args.dim)} values and --vocab {len(args.vocab)}: give one each")
    rows = []
    for name, overrides in ROWS.items():
        for r in args.rank if "{r}" in name else [None]:
            rows.append((name.format(r=r), [o.format(r=r) for o in overrides]))
    print("HF Llama, 8 layers, fp32, batch 2 x 256 tokens per rank, AdamW")
    measured = []
    for dim, vocab in zip(args.dim, args.vocab, strict=True):
        model_dir = _model_dir(args.cache, dim, vocab)
        for world in args.world:
            measured += _measure_shape(model_dir, dim=dim, vocab=vocab, world=world, rows=rows)
    results_io.write(NAME, rows=measured)
    render_docs()


if __name__ == "__main__":
    main()
