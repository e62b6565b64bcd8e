"""Tensor, sequence and context parallelism next to FSDP only on 2+ GPUs (NCCL, bf16),
and the GPU-only parts torch offers: async TP and ring attention.

**Needs a machine with 2 or more CUDA GPUs; not yet run** (the machine lent to the
session that wrote it has one H200). With fewer than 2 GPUs it prints one line and
exits 0, so it is safe to call anywhere; its first real run may need fixes.

    python bench/gpu_model_parallel.py                      # every GPU, up to 4 (~15 min, a guess)
    python bench/gpu_model_parallel.py --gpus 2 --rounds 1  # quicker
    python bench/gpu_model_parallel.py --only attention     # only the attention rows

Parts (``--only train,attention``):

- train: ``fsdpkit``'s own worker path (``fsdpkit.run.resolve`` -> ``build_session``
  -> the training loop, what ``fsdpkit train`` runs) under ``torchrun`` at N GPUs on
  llama3-1b, seq 8192, bf16 (fp32 reduce), global batch N sequences, micro-batch cap
  1, every setting identical but the layout: FSDP only; tp2 (+ sequence parallel);
  cp2 (Ulysses); cp2 (``parallel.cp_attention=ring``); pp2 with 1F1B (issue 38, not
  run on a GPU yet: the model untied and 4 micro-batches of 1 per rank, so its tokens/s
  is not FSDP only's batch); tp2 x cp2 (N >= 4); tp2
  compiled (``train.compile=true``); tp2 compiled with async TP
  (``parallel.async_tp=true``: fsdpkit sets inductor's ``_micro_pipeline_tp`` before
  compiling the blocks), so inductor fuses each
  all-gather -> matmul and matmul -> reduce-scatter pair of the sequence-parallel plan
  into a pipelined one; and the built-in MoE model (4 blocks of Qwen3-30B-A3B's shape)
  FSDP only and at ``parallel.ep=2`` (grouped GEMMs, NCCL all-to-alls; issue 37).
  Rounds run the rows in order (A B C ..., A B C ...); tokens/s is the loop's (compile
  excluded) over steps 4..N; memory: ``torch.cuda.memory_allocated`` after the build
  and ``max_memory_allocated`` at the end, the largest rank's.
- attention: one attention layer (q/k/v projections from a (1, S, 4096) input, 32
  heads of 128, causal SDPA, forward + backward) over cp = N ranks, S = --attn-seq
  tokens in all: fsdpkit's Ulysses exchange (``fsdpkit.sharding.context.attention
  .UlyssesAttention``: each rank a contiguous S / N slice), fsdpkit's ring
  (``fsdpkit.sharding.context.ring.RingAttention`` on head-tail chunks, what
  ``parallel.cp_attention=ring`` trains with) and torch's ring
  attention (``torch.distributed.tensor.experimental.context_parallel`` sharding the
  input with its causal load balancing, ``set_rotate_method("allgather")`` and
  ``("alltoall")``). Median ms per iteration over 10 after 3 warm-up, and peak memory.

Prints a table; writes bench/results/gpu_model_parallel.json (bench/results_io.py).
Exit 0 when every row ran, 1 when one failed (its row says why). Never run in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

NAME = "gpu_model_parallel"
SKIP = 3
"""Steps left out of tokens/s (the compiled rows compile in their first)."""
TRAIN = [
    "model.preset=llama3-1b", "data.seq_len=8192", "train.micro_batch_size=1",
    "precision.mode=auto", "train.steps=12", "data.max_bytes=4000000", "train.eval_every=0",
    "train.sample_tokens=0", "checkpoint.every=0", "checkpoint.resume=never",
    "logging.progress=none", "logging.report=false",
]  # fmt: skip
"""About 1.2B parameters, bf16 compute with fp32 reduce, 8192 tokens per sequence."""
COMPILED = ["parallel.tp=2", "parallel.cp=1", "train.compile=true"]
PIPELINE = [
    "parallel.tp=1", "parallel.cp=1", "parallel.pp=2", "model.tie_embeddings=false",
    "train.grad_accum=4",
]  # fmt: skip
MOE = [
    "model.preset=qwen3-30b-a3b", "model.n_layers=4", "data.seq_len=4096",
    "parallel.tp=1", "parallel.cp=1",
]  # fmt: skip
"""The MoE rows (issue 37): 4 blocks of Qwen3-30B-A3B's shape (128 experts of 768,
top 8), ~3B parameters, seq 4096; the experts run as grouped GEMMs
(``torch._grouped_mm``, fsdpkit.models.moe) and, at ep 2, each rank holds 64 of a
block's experts and sends tokens x 8 rows to the other with NCCL all-to-alls. Their
ratios are against the MoE FSDP-only row."""
RING = "parallel.cp_attention=ring"
"""fsdpkit's switch to torch's ring attention (fsdpkit.sharding.context.ring)."""
PARTS = ("train", "attention")


def train_rows(gpus: int) -> dict[str, tuple[str, list[str], bool]]:
    """row -> (label, layout overrides, async TP) for ``gpus`` GPUs."""
    rows = {
        "fsdp": (f"FSDP only (shard {gpus})", ["parallel.tp=1", "parallel.cp=1"], False),
        "tp": ("tp2 (+ sequence parallel)", ["parallel.tp=2", "parallel.cp=1"], False),
        "cp": ("cp2 (Ulysses)", ["parallel.tp=1", "parallel.cp=2"], False),
        "cp-ring": ("cp2 (ring attention)", ["parallel.tp=1", "parallel.cp=2", RING], False),
        # issue 38, not run on a GPU yet: the model untied (embedding and head on different
        # stages), 4 micro-batches per step (1F1B needs at least pp)
        "pp": ("pp2, 1F1B (untied, 4 micro-batches of 1; unrun)", PIPELINE, False),
    }
    if gpus >= 4:
        rows["tpcp"] = ("tp2 x cp2", ["parallel.tp=2", "parallel.cp=2"], False)
    rows["tp-compiled"] = ("tp2, compiled", COMPILED, False)
    async_tp = [*COMPILED, "parallel.async_tp=true"]  # fsdpkit's own switch
    rows["tp-async"] = ("tp2, compiled, async TP (micro-pipelined)", async_tp, True)
    rows["moe-fsdp"] = ("MoE: FSDP only", [*MOE, "parallel.ep=1"], False)
    rows["moe-ep2"] = (
        "MoE: ep2 (all-to-all dispatch, grouped GEMMs)",
        [*MOE, "parallel.ep=2"],
        False,
    )
    return rows


ATTENTION = {
    "ulysses": "fsdpkit Ulysses all-to-all (contiguous slices)",
    "fsdpkit-ring": "fsdpkit RingAttention (torch's ring SDPA on head-tail chunks)",
    "ring-allgather": "torch ring attention, set_rotate_method('allgather')",
    "ring-alltoall": "torch ring attention, set_rotate_method('alltoall')",
}


# -- workers: one process per GPU under torchrun -----------------------------------


def _train_worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from fsdpkit.run.resolve import resolve
    from fsdpkit.runtime.distenv import joined_env
    from fsdpkit.train.loop import run
    from fsdpkit.train.session import build_session

    env = joined_env()
    assert env is not None, "the train worker runs under torchrun"
    overrides = json.loads(args.overrides)
    cfg = resolve(
        None, overrides, world_size=env.world_size, local_world_size=env.local_world_size
    ).config
    session = build_session(cfg, env)  # parallel.async_tp in the overrides turns it on
    built = torch.cuda.memory_allocated() / 2**20
    run(session)
    return {
        "built_mib": built,
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
        "layout": session.trainable.plan.describe(),
    }


def _attention_step(impl: str, *, seq: int, mesh: Any) -> tuple[float, float]:
    """(median ms per forward + backward, peak MiB) of one attention layer over ``mesh``."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    from fsdpkit.sharding.context.attention import UlyssesAttention
    from fsdpkit.sharding.context.ring import RingAttention, enable_ring, head_tail_index

    heads, head_dim = 32, 128
    dim, cp, rank = heads * head_dim, mesh.size(), mesh.get_local_rank()
    torch.manual_seed(0)  # the same weights and input on every rank
    proj = torch.nn.Linear(dim, 3 * dim, bias=False, device="cuda", dtype=torch.bfloat16)
    full = torch.randn(1, seq, dim, device="cuda", dtype=torch.bfloat16)
    ulysses = UlyssesAttention(group=mesh.get_group(), cp=cp)

    def qkv(x: torch.Tensor) -> list[torch.Tensor]:
        b, s, _ = x.shape
        return [t.view(b, s, heads, head_dim).transpose(1, 2) for t in proj(x).chunk(3, -1)]

    def once() -> None:
        if impl == "ulysses":
            q, k, v = qkv(full.chunk(cp, dim=1)[rank].contiguous())
            ulysses(q, k, v, mask=None).float().sum().backward()
            return
        if impl == "fsdpkit-ring":
            enable_ring(device_type="cuda")
            q, k, v = qkv(full[:, head_tail_index(seq=seq, cp=cp, rank=rank, device=full.device)])
            RingAttention(mesh)(q, k, v, mask=None).float().sum().backward()
            return
        set_rotate_method(impl.removeprefix("ring-"))
        x = full.clone()  # sharded in place, not restored (no all-gather timed)
        with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1], no_restore_buffers={x}):
            q, k, v = qkv(x)
            F.scaled_dot_product_attention(q, k, v, is_causal=True).float().sum().backward()

    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if i == 3:
            torch.cuda.reset_peak_memory_stats()
        start.record()
        once()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**20


def _attention_worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    mesh = init_device_mesh("cuda", (dist.get_world_size(),), mesh_dim_names=("cp",))
    ms, peak = _attention_step(args.impl, seq=args.attn_seq, mesh=mesh)
    return {"ms": ms, "peak_mib": peak}


def worker(args: argparse.Namespace) -> int:
    """One rank of one row: measure, write ``--out``/rank-R.json, leave."""
    import torch.distributed as dist

    got = _train_worker(args) if args.worker == "train" else _attention_worker(args)
    rank = int(os.environ["RANK"])
    Path(args.out, f"rank-{rank}.json").write_text(json.dumps(got))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


# -- the parent: launch each row, collect, print --------------------------------------


def _launch(gpus: int, worker_args: list[str], *, tmp: Path) -> tuple[list[dict[str, Any]], str]:
    """Every rank's result of one row under torchrun, and its error ('' when it ran)."""
    out = Path(tempfile.mkdtemp(dir=tmp))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(gpus), __file__, *worker_args, "--out", str(out)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return [], f"exit {done.returncode}: " + " / ".join(tail)[-400:]
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))], ""


def _train_row(
    key: str, row: tuple[str, list[str], bool], *, gpus: int, tmp: Path, rnd: int
) -> dict[str, Any]:
    label, layout, async_tp = row
    run_dir = tmp / f"{key}-{rnd}"
    overrides = [*TRAIN, *layout, f"train.global_batch_size={gpus}", f"logging.run_dir={run_dir}"]
    args = ["--worker", "train", "--overrides", json.dumps(overrides)]
    ranks, error = _launch(gpus, args, tmp=tmp)
    if error:
        return {"key": key, "label": label, "error": error}
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tps = [r["tokens_per_s"] for r in records if "loss" in r][SKIP:]
    return {
        "key": key, "label": label, "overrides": layout, "async_tp": async_tp,
        "tokens_per_s": statistics.median(tps), "layout": ranks[0]["layout"],
        "built_mib": max(r["built_mib"] for r in ranks),
        "peak_mib": max(r["peak_mib"] for r in ranks),
    }  # fmt: skip


def _attention_row(impl: str, *, gpus: int, seq: int, tmp: Path) -> dict[str, Any]:
    args = ["--worker", "attention", "--impl", impl, "--attn-seq", str(seq)]
    ranks, error = _launch(gpus, args, tmp=tmp)
    if error:
        return {"key": impl, "label": ATTENTION[impl], "error": error}
    return {
        "key": impl, "label": ATTENTION[impl], "cp": gpus, "seq": seq,
        "ms": max(r["ms"] for r in ranks), "peak_mib": max(r["peak_mib"] for r in ranks),
    }  # fmt: skip


def _merge(runs: list[dict[str, Any]], field: str) -> dict[str, Any]:
    """One row of several rounds: the median of ``field``, the rounds' values kept."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    return {**ok[-1], field: statistics.median(r[field] for r in ok),
            f"{field}_rounds": [r[field] for r in ok]}  # fmt: skip


def measure(args: argparse.Namespace, gpus: int) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {"train": [], "attention": []}
    with tempfile.TemporaryDirectory(prefix="gpu-model-parallel-") as scratch:
        tmp = Path(scratch)
        if "train" in args.only:
            rows = train_rows(gpus)
            runs: dict[str, list[dict[str, Any]]] = {k: [] for k in rows}
            for rnd in range(args.rounds):
                for key, row in rows.items():
                    runs[key].append(_train_row(key, row, gpus=gpus, tmp=tmp, rnd=rnd))
                    print(f"  round {rnd} {key}: {runs[key][-1]}", flush=True)
            out["train"] = [_merge(r, "tokens_per_s") for r in runs.values()]
        if "attention" in args.only:
            for impl in ATTENTION:
                out["attention"].append(_attention_row(impl, gpus=gpus, seq=args.attn_seq, tmp=tmp))
                print(f"  attention {impl}: {out['attention'][-1]}", flush=True)
    return out


def table(results: dict[str, Any]) -> str:
    """The printed table: ratios against the FSDP-only row and the Ulysses row."""
    lines = [
        "| train row | tokens/s | vs FSDP only | after build | peak |",
        "|---|---:|---:|---:|---:|",
    ]
    bases = {
        k: next((r for r in results["train"] if r["key"] == k and "error" not in r), None)
        for k in ("fsdp", "moe-fsdp")
    }
    for r in results["train"]:
        if "error" in r:
            lines.append(f"| {r['label']} | FAILED: {r['error']} | | | |")
            continue
        base = bases["moe-fsdp" if r["key"].startswith("moe") else "fsdp"]
        vs = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"
        lines.append(
            f"| {r['label']} | {r['tokens_per_s']:,.0f} | {vs} | {r['built_mib']:,.0f} MiB | "
            f"{r['peak_mib']:,.0f} MiB |"
        )
    lines += ["", "| attention row | ms fwd+bwd | vs Ulysses | peak |", "|---|---:|---:|---:|"]
    ref = next(
        (r for r in results["attention"] if r["key"] == "ulysses" and "error" not in r), None
    )
    for r in results["attention"]:
        if "error" in r:
            lines.append(f"| {r['label']} | FAILED: {r['error']} | | |")
            continue
        vs = f"{r['ms'] / ref['ms']:.2f}" if ref else "-"
        lines.append(f"| {r['label']} | {r['ms']:.2f} | {vs} | {r['peak_mib']:,.0f} MiB |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpus", type=int, default=None, help="default: every GPU, up to 4")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--attn-seq", type=int, default=32768)
    parser.add_argument("--only", default=",".join(PARTS), help="comma-separated: train,attention")
    # the worker side (the parent passes these to itself under torchrun)
    parser.add_argument("--worker", choices=PARTS, help=argparse.SUPPRESS)
    parser.add_argument("--overrides", help=argparse.SUPPRESS)
    parser.add_argument("--impl", choices=list(ATTENTION), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        return worker(args)
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < 2:
        print(
            f"gpu_model_parallel: {found} CUDA GPU(s) here; these rows need a machine with "
            "2 or more (NCCL across GPUs): nothing measured."
        )
        return 0
    args.only = [p for p in args.only.split(",") if p]
    unknown = sorted(set(args.only) - set(PARTS))
    if unknown:
        _parser().error(f"unknown part(s) {unknown}: choose from {', '.join(PARTS)}")
    gpus = args.gpus or min(found, 4)
    measured = measure(args, gpus)
    import results_io

    results_io.write(
        NAME,
        command=f"python bench/gpu_model_parallel.py --gpus {gpus} --rounds {args.rounds} "
        f"--attn-seq {args.attn_seq} --only {','.join(args.only)}",
        gpus=gpus, gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
        settings={"train": TRAIN, "skip": SKIP, "rounds": args.rounds}, **measured,
    )  # fmt: skip
    print(table(results_io.read(NAME)))
    failed = [r for rows in measured.values() for r in rows if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
