"""Would ``torch.compile`` speed up the chunked loss? Eager vs compiled, one process.

    python bench/loss_compile.py                 # fp32 and bf16, 1024-token chunks
    python bench/loss_compile.py --reps 20 --vocab 128256 --dim 1024

Times one chunk's forward and backward of the chunked linear cross-entropy
(fsdpkit.loss.chunked_ce: logits, log-sum-exp in place; recomputed logits, softmax
minus one-hot, the two gradient matmuls) as a plain function, eager and compiled with
inductor (``torch.compile(fullgraph=True)``), alternating eager / compiled / eager
again (the control) per repetition. Prints per dtype the median time of each and the
ratios; compile time is measured apart (the first call). ``train.compile`` compiles
the blocks only: this bench is why.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

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


def measure(*, dtype: torch.dtype, tokens: int, vocab: int, dim: int, reps: int) -> str:
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
    name = str(dtype).removeprefix("torch.")
    return (
        f"{name:<6} {med['eager'] * 1e3:>9.1f} {med['compiled'] * 1e3:>11.1f} "
        f"{med['eager (again)'] * 1e3:>9.1f} {med['eager'] / med['compiled']:>9.2f}x "
        f"{med['eager'] / med['eager (again)']:>8.2f}x {first:>9.1f} {gap:>9.1e}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per chunk")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"one chunk of the chunked loss, forward + backward: {args.tokens} tokens x vocab "
        f"{args.vocab} x d {args.dim}, {args.threads} thread(s), median of {args.reps}"
    )
    print("dtype  eager ms  compiled ms  again ms   speedup  control  compile s  rel. gap")
    for dtype in (torch.float32, torch.bfloat16):
        print(measure(dtype=dtype, tokens=args.tokens, vocab=args.vocab, dim=args.dim,
                      reps=args.reps))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
