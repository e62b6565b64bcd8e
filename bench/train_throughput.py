"""Tokens/s of ``fsdpkit train`` vs a minimal hand-written FSDP2 loop (handwritten_loop.py).

    .venv/bin/python bench/train_throughput.py [--reps 3] [--steps 40]

Same model (tiny preset), data (built-in corpus), sequence length, batch and 2 CPU
ranks; runs alternate (hand, fsdpkit, hand, fsdpkit, ...) so noise hits both alike.
Both exclude the first two steps. Ratio = fsdpkit / hand tokens/s (>= 0.98 expected).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent


def _hand(*, steps: int, seq: int, batch: int, tmp: Path) -> float:
    out = tmp / "hand.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(HERE / "handwritten_loop.py"),
            str(steps),
            str(seq),
            str(batch),
            str(out),
        ],
        check=True,
        capture_output=True,
        env=_env(),
    )
    return float(json.loads(out.read_text())["tokens_per_s"])


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _fsdpkit(*, steps: int, seq: int, batch: int, tmp: Path, rep: int) -> float:
    run_dir = tmp / f"kit-{rep}"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "fsdpkit",
            "train",
            f"train.steps={steps}",
            f"data.seq_len={seq}",
            f"train.micro_batch_size={batch}",
            "train.eval_every=0",
            "train.sample_tokens=0",
            "checkpoint.resume=never",
            "logging.progress=none",
            f"logging.run_dir={run_dir}",
        ],
        check=True,
        capture_output=True,
        env=_env(),
    )
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r["step_time_s"] for r in records if "loss" in r][2:]
    return batch * seq * 2 * len(steady) / sum(steady)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    hand, kit = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            common = {"steps": args.steps, "seq": args.seq, "batch": args.batch, "tmp": Path(tmp)}
            hand.append(_hand(**common))
            kit.append(_fsdpkit(**common, rep=rep))
    print(
        f"tiny preset, seq {args.seq}, micro-batch {args.batch}/rank, 2 CPU ranks, fp32, "
        f"{args.steps} steps x {args.reps} alternating runs (first 2 steps excluded)"
    )
    print(f"{'loop':<22}{'tokens/s (median)':>18}{'runs':>30}{'ratio':>8}")
    base = statistics.median(hand)
    for label, values in [("hand-written FSDP2", hand), ("fsdpkit train", kit)]:
        runs = ", ".join(f"{v:,.0f}" for v in values)
        print(
            f"{label:<22}{statistics.median(values):>18,.0f}{runs:>30}"
            f"{statistics.median(values) / base:>8.3f}"
        )


if __name__ == "__main__":
    main()
