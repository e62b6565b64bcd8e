"""The wall-clock bounds the tests used to assert, measured here instead.

    .venv/bin/python bench/wall_clock.py [--skip-traced]

Tests check what these calls compute; how long they take depends on the machine and
its load, so it is measured by this script and never asserted in CI. Each row times
one call (best of ``--reps``) against the bound the docs state:

- analytic plan of Llama 3 405B at 1024 ranks (docs/planner.md: under a second)
- ``recommend`` for Llama 3 8B on 8 x H100 (under 10 s)
- traced plan of Llama 3 8B, full AC, at 8 and 64 ranks (under 3 minutes each)
- byte-tokenizing a 4 MB text file, prepared and read back (under 2 s)

Prints a table and writes bench/results/wall_clock.json; exits 1 when a row is over.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from fsdpkit.config import DataConfig, load
from fsdpkit.data import ByteTokenizer, load_token_stream
from fsdpkit.planner import parse_device, plan
from fsdpkit.planner.search.recommend import recommend

RESULTS = Path(__file__).parent / "results" / "wall_clock.json"
H100 = parse_device("h100")


def _plan_405b() -> None:
    cfg = load(None, ["model.preset=llama3-405b", "data.seq_len=8192", "train.micro_batch_size=1"])
    plan(cfg, world_size=1024, device=H100)


def _recommend_8b() -> None:
    cfg = load(None, ["model.preset=llama3-8b", "data.seq_len=8192", "train.micro_batch_size=2"])
    recommend(cfg, world_size=8, device=H100)


def _traced_8b(world: int) -> Callable[[], None]:
    def run() -> None:
        cfg = load(
            None,
            [
                "model.preset=llama3-8b", "data.seq_len=2048", "train.micro_batch_size=1",
                "activations.mode=full",
            ],
        )  # fmt: skip
        plan(cfg, world_size=world, device=H100, trace=True)

    return run


def _tokenize_4mb() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big.txt"
        path.write_text("héllo wörld, " * 330_000)
        load_token_stream(DataConfig(path=str(path), max_bytes=3_999_999), ByteTokenizer())


def _best_of(fn: Callable[[], None], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="timed calls per row (best kept)")
    parser.add_argument("--skip-traced", action="store_true", help="leave out the 8B traces")
    args = parser.parse_args(argv)
    rows: list[tuple[str, Callable[[], None], float, int]] = [
        ("plan llama3-405b @1024 (analytic)", _plan_405b, 1.0, args.reps),
        ("recommend llama3-8b @8 x h100", _recommend_8b, 10.0, args.reps),
        ("byte-tokenize 4 MB text", _tokenize_4mb, 2.0, args.reps),
    ]
    if not args.skip_traced:
        rows += [(f"plan llama3-8b @{w} --trace", _traced_8b(w), 180.0, 1) for w in (8, 64)]
    out = []
    print(f"{'call':<36} {'seconds':>8} {'bound':>7}  ok")
    for name, fn, bound, reps in rows:
        seconds = _best_of(fn, reps)
        out.append({"call": name, "seconds": round(seconds, 3), "bound_s": bound})
        print(f"{name:<36} {seconds:8.2f} {bound:7.0f}  {'ok' if seconds <= bound else 'OVER'}")
    RESULTS.parent.mkdir(exist_ok=True)
    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.node()}
    RESULTS.write_text(json.dumps({**meta, "rows": out}, indent=2) + "\n")
    return 0 if all(r["seconds"] <= r["bound_s"] for r in out) else 1


if __name__ == "__main__":
    sys.exit(main())
