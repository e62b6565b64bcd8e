"""bench/levers.py's table on GPUs: each issue-12 lever on vs off, NCCL, torchrun.

    python bench/gpu_levers.py --nproc 8                 # spawns torchrun --standalone
    torchrun --standalone --nproc-per-node 8 bench/gpu_levers.py --reps 3
    python bench/gpu_levers.py --nproc 1 --only accum --reps 2 --steps 4

The same ``LEVERS`` rows and the same worker as bench/levers.py (``build_session`` and
the trainer's step, alternating rounds, a same-vs-same control row), on a bf16
Llama of ``GPU_BASE`` with CUDA ranks; peak = ``torch.cuda.max_memory_allocated`` of
one measured step, max over ranks. Explicit prefetch and per-micro-batch
reduce-scatter only show their GPU trade-offs here (overlap on NCCL's own streams);
on CPU/gloo collectives run on the critical path. Only for a machine with GPUs; no
numbers from this script are in the docs until it has run on one.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import levers  # bench/levers.py: the rows, the worker, the table

GPU_BASE: tuple[str, ...] = (
    "model.preset=llama3-1b", "data.seq_len=2048", "data.max_bytes=4000000",
    "train.micro_batch_size=2", "precision.mode=bf16", "activations.mode=full",
    "train.eval_every=0", "train.sample_tokens=0", "checkpoint.every=0",
    "checkpoint.resume=never", "logging.progress=none", "logging.report=false",
)  # fmt: skip
"""About 1.2B parameters, bf16 compute with fp32 reduce, 2 x 2048 tokens per rank."""


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    chosen = levers.select(args.only)
    start = time.perf_counter()
    mine = levers.measure(
        rank,
        world,
        chosen,
        args.reps,
        args.steps,
        args.warmup,
        "cuda",
        GPU_BASE,
    )
    gathered: list[object] = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        print(
            f"issue 12 levers on {world} x {torch.cuda.get_device_name()} (NCCL), "
            f"{' '.join(GPU_BASE[:5])}; {args.reps} alternating rounds x "
            f"({args.warmup} warm-up + {args.steps} timed steps) per side; "
            f"{time.perf_counter() - start:.0f} s"
        )
        memory = "torch.cuda.max_memory_allocated of one step per rank, max over ranks"
        print(levers.table(levers.merge(gathered), memory=memory))  # type: ignore[arg-type]
    dist.destroy_process_group()
    return 0


def _without_nproc(argv: list[str]) -> list[str]:
    """The arguments the workers get: ``--nproc N`` and ``--nproc=N`` are the launcher's."""
    rest: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    return rest


def main(argv: list[str] | None = None) -> int:
    p = levers.parser(__doc__ or "")
    p.add_argument("--nproc", type=int, default=0, help="GPUs to spawn torchrun on (0: all)")
    args = p.parse_args(argv)
    if "RANK" in os.environ:  # under torchrun
        return _worker(args)
    import torch

    if not torch.cuda.is_available():
        print("bench/gpu_levers.py needs CUDA GPUs; on CPU run bench/levers.py.", file=sys.stderr)
        return 2
    nproc = args.nproc or torch.cuda.device_count()
    rest = _without_nproc(argv if argv is not None else sys.argv[1:])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", __file__, *rest]  # fmt: skip
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
