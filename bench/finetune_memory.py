"""Per-rank memory of LoRA and frozen-weight fine-tuning against a full fine-tune.

    python bench/finetune_memory.py                     # HF Llama d=512, 8 layers, vocab 32000
    python bench/finetune_memory.py --world 2 4 --rank 8 64
    python bench/finetune_memory.py --dim 1024 --vocab 4096  # blocks dominate, not embeddings

Writes a random-weight Hugging Face Llama directory once (under --cache), then for each
row runs on N gloo ranks what ``fsdpkit train model.hf=DIR ...`` does: build on meta,
``[lora]`` / ``model.freeze`` (fsdpkit.finetune.prepare), shard, read each rank's slices,
build fsdpkit's AdamW, one warm-up step, then one measured step of fsdpkit's training
step (batch 2 x 256 tokens per rank, fp32). Per rank it reports:

- trainable elements this rank holds, and the optimizer state bytes measured from the
  optimizer itself (AdamW's exp_avg + exp_avg_sq: 8 bytes per trainable element);
- the step's true peak of live CPU tensor memory, from c10's allocator with
  process-wide accounting ([Note: measuring CPU peaks] in fsdpkit.cpumem),
  minus what the process held before the model was built;
- the ratio of that peak to the full fine-tune's at the same world size.

Memory is exact and repeatable here (not a timing), so one run per row suffices; the
"full (again)" row is a same-vs-same control that must read 1.00.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fsdpkit.testing import run_ranks

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world", type=int, nargs="+", default=[2])
    p.add_argument("--rank", type=int, nargs="+", default=[16], help="LoRA ranks to measure")
    p.add_argument("--dim", type=int, default=512, help="hidden size")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary")
    p.add_argument("--cache", default="/tmp/fsdpkit-bench-finetune", help="model directory cache")
    args = p.parse_args()
    model_dir = Path(args.cache) / f"llama-d{args.dim}-v{args.vocab}-l8"
    if not (model_dir / "config.json").is_file():
        from fsdpkit.testing.hf import write_tiny_model

        write_tiny_model(
            model_dir, arch="llama", vocab_size=args.vocab, dim=args.dim, layers=8, heads=8,
            kv_heads=4, ffn=args.dim * 11 // 4, tokenizer=False,
        )  # fmt: skip
    rows = []
    for name, overrides in ROWS.items():
        for r in args.rank if "{r}" in name else [None]:
            rows.append((name.format(r=r), [o.format(r=r) for o in overrides]))
    print(f"model: {model_dir} (HF Llama, fp32), batch 2 x 256 tokens per rank, AdamW")
    head = ("world", "row", "trainable/rank", "of total", "optimizer/rank", "= 8 B/elem")
    print("{:>5}  {:<28} {:>15} {:>9} {:>15} {:>10}".format(*head), "step peak/rank  x full")
    for world in args.world:
        full = None
        for name, overrides in rows:
            job = (str(model_dir), overrides, args.vocab)
            got = run_ranks(_measure, world_size=world, args=job, timeout_s=900)
            peak = max(g["peak"] for g in got)
            full = full or peak
            g = got[0]
            share = 100 * sum(x["trainable"] for x in got) / g["total"]
            exact = all(x["optimizer_bytes"] == 8 * x["trainable"] for x in got)
            print(
                f"{world:>5}  {name:<28} {g['trainable']:>15,} {share:>8.2f}% "
                f"{g['optimizer_bytes'] / MIB:>11.2f} MiB {'yes' if exact else 'NO':>10} "
                f"{peak / MIB:>11.1f} MiB {peak / full:>7.2f}"
            )


if __name__ == "__main__":
    main()
