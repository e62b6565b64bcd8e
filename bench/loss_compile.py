"""Would ``torch.compile`` speed up the chunked loss? Eager vs compiled, one process.

    python bench/loss_compile.py                 # fp32 and bf16, 1024-token chunks
    python bench/loss_compile.py --reps 20 --vocab 128256 --dim 1024

Times one chunk's forward and backward of the chunked linear cross-entropy
(fsdpkit.loss.chunked_ce: logits, log-sum-exp in place; recomputed logits, softmax
minus one-hot, the two gradient matmuls) as a plain function, eager and compiled with
inductor (``torch.compile(fullgraph=True)``), alternating eager / compiled / eager
again (the control) per repetition. Prints per dtype the median time of each and the
ratios; compile time is measured apart (the first call). ``train.compile`` compiles
the blocks only: this bench is why. Writes ``bench/results/loss_compile.json`` and
renders docs/levers-act.md's table from it (``--render-docs`` only re-renders).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import results_io
import torch

from fsdpkit.data.batch import IGNORE_INDEX
from fsdpkit.loss.chunked_ce import _chunk_grad, _logits, _logsumexp_


def chunk_step(h: torch.Tensor, w: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """Forward and backward of one chunk with fsdpkit's own chunk functions (the
    in-place log-sum-exp and gradient), returning the sums of the hidden states' and
    the weight's gradients (so nothing is dead code)."""
    lse = _logsumexp_(_logits(h, w, None).float())
    g = _chunk_grad(h, w, None, tgt, lse, torch.ones((), dtype=torch.float32), IGNORE_INDEX)
    return (g @ w).float().sum() + (g.t() @ h).float().sum()


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


NAME = "loss_compile"
DOCS = results_io.ROOT / "docs" / "levers-act.md"


def measure(*, dtype: torch.dtype, tokens: int, vocab: int, dim: int, reps: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, dim, generator=g).to(dtype)
    w = (torch.randn(vocab, dim, generator=g) * dim**-0.5).to(dtype)
    tgt = torch.randint(0, vocab, (tokens,), generator=g)
    compiled = torch.compile(chunk_step, fullgraph=True)
    first = _time(lambda: compiled(h, w, tgt))
    eager_out, compiled_out = chunk_step(h, w, tgt), compiled(h, w, tgt)
    gap = float((eager_out - compiled_out).abs() / eager_out.abs())
    times: dict[str, list[float]] = {"eager": [], "compiled": [], "eager (again)": []}
    for _ in range(reps):
        times["eager"].append(_time(lambda: chunk_step(h, w, tgt)))
        times["compiled"].append(_time(lambda: compiled(h, w, tgt)))
        times["eager (again)"].append(_time(lambda: chunk_step(h, w, tgt)))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "eager_ms": round(med["eager"] * 1e3, 1),
        "compiled_ms": round(med["compiled"] * 1e3, 1),
        "eager_again_ms": round(med["eager (again)"] * 1e3, 1),
        "speedup": round(med["eager"] / med["compiled"], 3),
        "control": round(med["eager"] / med["eager (again)"], 3),
        "compile_s": round(first, 1),
        "rel_gap": gap,
    }


def render(results: dict[str, Any]) -> str:
    """docs/levers-act.md's table (tests/unit/test_bench_docs.py checks it)."""
    lines = [
        results_io.provenance(results, NAME),
        "",
        f"One chunk of the chunked loss, forward + backward: {results['tokens']} tokens x "
        f"vocab {results['vocab']} x d {results['dim']}, {results['threads']} thread(s), "
        f"median of {results['reps']}; speedup = eager / compiled, control = eager / eager "
        "again.",
        "",
        "| dtype | eager ms | compiled ms | eager again ms | speedup | control | compile s "
        "| rel. gap |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['dtype']} | {r['eager_ms']:.1f} | {r['compiled_ms']:.1f} | "
            f"{r['eager_again_ms']:.1f} | {r['speedup']:.2f}x | {r['control']:.2f}x | "
            f"{r['compile_s']:.1f} | {r['rel_gap']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def render_docs() -> None:
    results_io.render_into(DOCS, NAME, render(results_io.read(NAME)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per chunk")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--render-docs", action="store_true", help="only re-render the docs table")
    args = p.parse_args()
    if args.render_docs:
        render_docs()
        return 0
    torch.set_num_threads(args.threads)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        rows.append(measure(dtype=dtype, tokens=args.tokens, vocab=args.vocab, dim=args.dim,
                            reps=args.reps))  # fmt: skip
        print(rows[-1], flush=True)
    results_io.write(
        NAME, tokens=args.tokens, vocab=args.vocab, dim=args.dim, threads=args.threads,
        reps=args.reps, rows=rows,
    )  # fmt: skip
    render_docs()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
