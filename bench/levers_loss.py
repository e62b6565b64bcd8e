"""Chunked linear cross-entropy on and off: per-rank peak memory and tokens/s, CPU ranks.

    python bench/levers_loss.py                  # built-in Llama and HF Llama, 32k vocab
    python bench/levers_loss.py --reps 6 --chunk 256

Each row is one model (the built-in tiny Llama widened to d=256 with a 32768-token
vocabulary, and the same shape as an HF ``LlamaForCausalLM`` loaded through
``model.hf``), on 2 gloo ranks, fp32, 2 x 1024 tokens per rank, trained by fsdpkit's
own step (fsdpkit.trainable.step) with the full-logits loss ("off") or the chunked one
("on", fsdpkit.loss.head.ChunkedLoss). The two losses drive the same sharded
model and optimizer, alternating step by step, ``--reps`` times each, with a third
"off (again)" same-vs-same control that must read ~1.00. Reported per mode:

- peak: the true peak of live CPU tensor memory of one step per rank (c10's
  process-wide allocator count, [Note: measuring CPU peaks] in
  fsdpkit.cpumem), exact and repeatable;
- tokens/s over both ranks: the median step time of the reps (timed without the
  profiler), and its ratio to "off".
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # tiny_hf

from fsdpkit.testing import run_ranks

SHAPE = {"dim": 256, "vocab_size": 32768, "seq_len": 1024, "micro": 2}
MODES = ("off", "on", "off (again)")
MIB = 2**20


def _model(row: str, model_dir: str) -> Any:
    from fsdpkit.config import ModelConfig
    from fsdpkit.models.factory import build_model

    if row == "HF Llama":
        cfg = ModelConfig(hf=model_dir)
    else:
        cfg = ModelConfig(preset="tiny", dim=SHAPE["dim"], vocab_size=SHAPE["vocab_size"])
    return build_model(cfg, vocab_size=SHAPE["vocab_size"], seq_len=SHAPE["seq_len"], seed=0)


def _row(rank: int, row: str, model_dir: str, *, reps: int, chunk: int) -> dict[str, Any]:
    import torch

    from fsdpkit import build_mesh, shard
    from fsdpkit.config import RunConfig, TrainConfig
    from fsdpkit.cpumem import live_bytes, peak_bytes
    from fsdpkit.loss.contract import next_token_loss
    from fsdpkit.loss.head import ChunkedLoss
    from fsdpkit.trainable.optim import build_optimizer
    from fsdpkit.trainable.step import train_step

    base = live_bytes()
    built = _model(row, model_dir)
    model = built.module
    shard(model, RunConfig(), mesh=build_mesh(), init=built.init)
    opt = build_optimizer(model, TrainConfig())
    gen = torch.Generator().manual_seed(rank)
    size = (SHAPE["micro"], SHAPE["seq_len"] + 1)
    batch = [torch.randint(0, SHAPE["vocab_size"], size, generator=gen)]
    losses = {"off": next_token_loss, "on": ChunkedLoss(chunk_tokens=chunk)}
    losses["off (again)"] = next_token_loss

    def step(mode: str) -> None:
        train_step(model, opt, batch, loss_fn=losses[mode], max_norm=1.0)

    out: dict[str, Any] = {m: {"times": []} for m in MODES}
    for mode in MODES:  # warm-up (AdamW states), then the exact peak
        step(mode)
        out[mode]["peak"] = peak_bytes(lambda m=mode: step(m)) - base
    for _ in range(reps):
        for mode in MODES:
            start = time.perf_counter()
            step(mode)
            out[mode]["times"].append(time.perf_counter() - start)
    return out


def _all(rank: int, world: int, model_dir: str, reps: int, chunk: int) -> dict[str, Any]:
    from fsdpkit.cpumem import enable_process_wide_accounting

    enable_process_wide_accounting()
    return {row: _row(rank, row, model_dir, reps=reps, chunk=chunk) for row in ROWS}


ROWS = ("built-in Llama", "HF Llama")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=4, help="timed steps per mode")
    parser.add_argument("--chunk", type=int, default=1024, help="train.loss_chunk_tokens")
    args = parser.parse_args(argv)
    from tiny_hf import write_tiny_model

    with tempfile.TemporaryDirectory(prefix="levers-loss-") as tmp:
        model_dir = write_tiny_model(
            Path(tmp) / "llama", arch="llama", vocab_size=SHAPE["vocab_size"],
            dim=SHAPE["dim"], layers=4, heads=8, kv_heads=4, ffn=688,
            max_positions=SHAPE["seq_len"], tokenizer=False,
        )  # fmt: skip
        start = time.perf_counter()
        ranks = run_ranks(
            _all, world_size=2, args=(str(model_dir), args.reps, args.chunk), timeout_s=3600
        )
    tokens = 2 * SHAPE["micro"] * SHAPE["seq_len"]
    head = f"{'model':<16}{'loss':<13}{'peak/rank':>11}{'vs off':>8}{'tokens/s':>10}{'vs off':>8}"
    print(head + f"   (2 ranks, fp32, 2 x {SHAPE['seq_len']} tokens/rank, chunk {args.chunk})")
    print("-" * len(head))
    for row in ROWS:
        peak = {m: max(r[row][m]["peak"] for r in ranks) for m in MODES}
        speed = {
            m: tokens / statistics.median(max(t) for t in zip(*(r[row][m]["times"] for r in ranks)))
            for m in MODES
        }
        for m in MODES:
            print(
                f"{row:<16}{m:<13}{peak[m] / MIB:>10.1f}M{peak[m] / peak['off']:>8.2f}"
                f"{speed[m]:>10.0f}{speed[m] / speed['off']:>8.2f}"
            )
    print(f"\n{args.reps} alternating timed steps per mode in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
