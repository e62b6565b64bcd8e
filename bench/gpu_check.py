"""Every CUDA/NCCL statement of the docs that one GPU can check, in one run.

Written to finish in under 8 minutes on one H200; run once, on one H200 with the lent
image's torch 2.11 (bench/results/gpu_check.json, ``render`` counts its rows).

    python bench/gpu_check.py                  # on a machine with one CUDA GPU
    python bench/gpu_check.py --only parity,planner
    python bench/gpu_check.py --dry-run        # anywhere: the CPU-side parts only

Sections (each a row or a few of the table; a failing section is a row, not a crash):

- device: ``precision.mode = auto`` resolves to bf16, the GPU is found in the device
  table (MFU's peak), ``build_mesh()`` picks cuda, the process group is NCCL
- nccl: NCCL init through a file store, a 64 MiB all-reduce, and every TCP listener
  of the process on loopback with the launcher's ``NCCL_SOCKET_IFNAME``
- parity: 1-rank FSDP2 bf16 (fp32 reduce) against the same arithmetic unsharded
  (tests/support.py ``train_mixed``): loss, grad norm, parameters over 5 steps
- adamw: ``train.optimizer_impl = auto`` is fused on CUDA shards; fused vs foreach
- staging: async checkpoint staging buffers are pinned and copy at PCIe speed
- offload: ``offload.params`` shards live in pinned host memory and train
- compile: ``train.compile`` on CUDA compiles (Triton) and matches eager
- planner: analytic plan vs ``torch.cuda.max_memory_allocated`` (was gpu_plan_check.py)
- train: ``fsdpkit train --nproc 1`` of llama3-1b at 4096 tokens: MFU over the GPU's
  dense peak, ``peak_mem_kind``, peak vs plan, the workers' listeners on loopback
- doctor: ``fsdpkit doctor`` statuses of its GPU-side checks on this machine
- vllm: GRPO with rl.engine = vllm (sleep mode, bf16) on the GPU, when vLLM is installed
  ($FSDPKIT_VLLM_PYTHON): the log-prob gap, the push's seconds, the listeners

Prints a table; writes bench/results/gpu_check.json. Exit 1 if any row fails, 2
without CUDA (unless --dry-run). Never run in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_sections import (
    IN_PROCESS,
    PLAN_ROWS,
    ROOT,
    GiB,
    Row,
    all_loopback,
    bf16_config,
    listeners,
    planned,
)

from fsdpkit import netinfo
from fsdpkit.config import load
from fsdpkit.devices import detected_device, parse_device

RESULTS = ROOT / "bench" / "results" / "gpu_check.json"


# -- sections that run fsdpkit's CLI in a child --------------------------------------

TRAIN = (
    "model.preset=llama3-1b", "data.seq_len=4096", "train.micro_batch_size=1",
    "precision.mode=auto", "train.steps=16", "data.max_bytes=4000000", "train.eval_every=0",
    "train.sample_tokens=0", "checkpoint.every=0", "checkpoint.resume=never",
    "logging.progress=none", "logging.report=false",
)  # fmt: skip
"""About 1.2B parameters, bf16 compute with fp32 reduce, 4096 tokens per step."""


def check_train() -> list[Row]:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "fsdpkit", "train", "--nproc", "1", *TRAIN,
               f"logging.run_dir={run_dir}"]  # fmt: skip
        log = Path(tmp) / "train.log"
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
            seen: list[str] = []
            while proc.poll() is None:
                seen += listeners(_tree(proc.pid))
                time.sleep(2)
        tail = log.read_text()[-400:]
        if proc.returncode != 0:
            return [Row("train", "fsdpkit train --nproc 1 on CUDA", f"exit {proc.returncode}: "
                        f"{tail}", False)]  # fmt: skip
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = rows[len(rows) // 2 :]
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    mfu = statistics.median(mfus) if mfus else None
    peak = max(max(r["peak_mem_mib"]) for r in steady) * 2**20  # a list: one per rank
    device = detected_device()
    predicted = planned(load(None, list(TRAIN)), device) if device else 0
    addrs = sorted(set(seen))
    return [
        Row("train", "MFU reported over the GPU's dense peak", f"{mfu}", mfu is not None),
        Row("train", "MFU of llama3-1b at 4096 tokens (design target ~40%)",
            f"{mfu:.1%}" if mfu else "-", None if mfu is None else mfu >= 0.40),
        Row("train", "peak_mem_kind is cuda_max_allocated", steady[0]["peak_mem_kind"],
            steady[0]["peak_mem_kind"] == "cuda_max_allocated"),
        Row("train", "run's peak vs plan (includes the allocator's baseline)",
            f"{peak / GiB:.2f} GiB vs plan {predicted / GiB:.2f} GiB", None),
        Row("train", "the run's listeners (store, NCCL) bind to loopback",
            ", ".join(addrs) or "none seen", all_loopback(addrs) if addrs else None),
    ]  # fmt: skip


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc/*/stat parent ids)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    tree, changed = {pid}, True
    while changed:
        grown = {p for p, parent in parents.items() if parent in tree} | tree
        changed, tree = grown != tree, grown
    return sorted(tree)


SKIPPABLE = ("p2p", "compile")
"""Doctor checks that skip on one GPU (no peer) or with train.compile off."""


def check_doctor() -> list[Row]:
    cmd = [sys.executable, "-m", "fsdpkit", "doctor", "--json", "--no-trace", "--nproc", "1"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    rows = []
    for name in ("torch", "backends", "gpus", "bf16", "p2p", "shm", "compile"):
        c = checks.get(name, {"status": "absent", "message": ""})
        ok = c["status"] == "ok" or (c["status"] == "skip" and name in SKIPPABLE)
        rows.append(Row("doctor", f"doctor '{name}' on this GPU machine",
                        f"{c['status']}: {c['message'][:90]}",
                        ok))  # fmt: skip
    return rows


def _vllm_python() -> str | None:
    """The Python that has vLLM: $FSDPKIT_VLLM_PYTHON, else this one if it imports vllm."""
    chosen = os.environ.get("FSDPKIT_VLLM_PYTHON") or sys.executable
    probe = subprocess.run([chosen, "-c", "import vllm"], capture_output=True, timeout=300)
    return chosen if probe.returncode == 0 else None


def check_vllm() -> list[Row]:
    """rl.engine = vllm on one GPU (docs/rl-vllm.md, "Awaiting a GPU"): sleep mode on, bf16,
    5 GRPO steps of a 4-layer Llama with 64-wide heads."""
    python = _vllm_python()
    if python is None:
        return [Row("vllm", "GRPO with rl.engine = vllm on CUDA", "vLLM not installed here "
                    "(set FSDPKIT_VLLM_PYTHON to a Python that has it)", None)]  # fmt: skip
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from tiny_hf import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "model", arch="llama", dim=512, heads=8,
                                 kv_heads=4, layers=4, ffn=1376, vocab_size=320)  # fmt: skip
        data = Path(tmp) / "prompts.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n"
                                for i in range(256)))  # fmt: skip
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "fsdpkit", "train", "--nproc", "1", "train.objective=grpo",
               f"model.hf={model}", f"data.path={data}", f"logging.run_dir={run_dir}",
               "data.val_fraction=0", 'rl.rewards=["exact"]', "rl.num_generations=8",
               "rl.max_completion_length=64", "rl.max_prompt_length=16",
               "train.global_batch_size=64", "train.micro_batch_size=16", "train.steps=5",
               "precision.mode=auto", "train.eval_every=0", "train.sample_tokens=0",
               "checkpoint.every=0", "logging.progress=none", "logging.report=false",
               "rl.engine=vllm", f"rl.vllm_python={python}"]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seen: list[str] = []
        while proc.poll() is None:
            seen += listeners(_tree(proc.pid))
            time.sleep(2)
        out = proc.stdout.read() if proc.stdout else ""
        if proc.returncode != 0:
            return [Row("vllm", "GRPO with rl.engine = vllm on CUDA", f"exit {proc.returncode}: "
                        f"{out[-400:]}", False)]  # fmt: skip
        steps = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                 if "loss" in r]  # fmt: skip
    gap = max(r["rl/logprob_gap_max"] for r in steps)
    push = statistics.median(r["rl/sync_s"] for r in steps)
    rate = statistics.median(r["rl/rollout_tokens_per_s"] for r in steps)
    addrs = sorted(set(seen))
    return [
        Row("vllm", "GRPO with rl.engine = vllm, sleep mode: 5 steps on CUDA", "ok", True),
        Row("vllm", "largest log-prob gap, vLLM vs FSDP2 bf16 (limit 0.1)", f"{gap:.3g}",
            gap <= 0.1),
        Row("vllm", "weight push per update (rl/sync_s, median)", f"{push * 1000:.0f} ms", None),
        Row("vllm", "rollout tokens/s (median)", f"{rate:,.0f}", None),
        Row("vllm", "the run's and its engine's listeners bind to loopback",
            ", ".join(addrs) or "none seen", all_loopback(addrs) if addrs else None),
    ]  # fmt: skip


CHILDREN: dict[str, Callable[[], list[Row]]] = {
    "train": check_train,
    "doctor": check_doctor,
    "vllm": check_vllm,
}


def run_sections(names: list[str]) -> list[Row]:
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(netinfo.socket_ifname_env(netinfo.collective_interface(peer=None),
                                                    current=os.environ))  # fmt: skip
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1)
        try:
            rows += _each([n for n in names if n in IN_PROCESS], IN_PROCESS)
        finally:
            dist.destroy_process_group()
            torch.cuda.empty_cache()  # the children need the memory this process cached
    return rows + _each([n for n in names if n in CHILDREN], CHILDREN)


def _each(names: list[str], table: dict[str, Callable[[], list[Row]]]) -> list[Row]:
    rows = []
    for name in names:
        start = time.perf_counter()
        try:
            rows += table[name]()
        except Exception as e:  # one section's failure is its row, not the end of the run
            rows.append(Row(name, "section ran", f"{type(e).__name__}: {e}"[:300], False))
        print(f"[{name}: {time.perf_counter() - start:.0f} s]", file=sys.stderr, flush=True)
    return rows


def dry_run() -> list[Row]:
    """What runs without CUDA: the plans the planner section compares with (for an
    H200), and the listener reader on a socket of its own."""
    h200 = parse_device("h200")
    rows = [Row("planner", f"plan (H200, analytic): {name}",
                f"{planned(bf16_config(*o), h200) / GiB:.2f} GiB", None)
            for name, o in PLAN_ROWS.items()]  # fmt: skip
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        found = listeners(_tree(os.getpid()))
        want = f"127.0.0.1:{sock.getsockname()[1]}"
    rows.append(Row("nccl", "listener reader finds a loopback socket", ", ".join(found) or "none",
                    want in found and all_loopback(found)))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    sections = [*IN_PROCESS, *CHILDREN]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help=f"comma-separated of: {','.join(sections)}")
    parser.add_argument("--dry-run", action="store_true", help="CPU-side parts only, no CUDA")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or sections
    unknown = sorted(set(names) - set(sections))
    if unknown:
        parser.error(f"--only: unknown section(s) {unknown}; choose from {sections}")
    if args.dry_run:
        rows = dry_run()
    elif not torch.cuda.is_available():
        print("bench/gpu_check.py: no CUDA device here (torch.cuda.is_available() is False). "
              "Run it on a machine with a GPU, or pass --dry-run for the CPU-side parts.",
              file=sys.stderr)  # fmt: skip
        return 2
    else:
        rows = run_sections(names)
    print(f"{'section':<9} {'ok':<5} {'claim':<62} measured")
    for r in rows:
        mark = {True: "ok", False: "FAIL", None: "-"}[r.ok]
        print(f"{r.section:<9} {mark:<5} {r.claim:<62} {r.measured}")
    if not args.dry_run:
        meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                "machine": platform.node(), "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name()}  # fmt: skip
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps({**meta, "rows": [asdict(r) for r in rows]}, indent=1))
    return 1 if any(r.ok is False for r in rows) else 0


def render(results: dict[str, Any]) -> str:
    """How many rows of a results file held, failed, or only report a figure (README's
    "Measured" row quotes it; tests/unit/test_readme_measured.py checks the quote)."""
    rows = results["rows"]
    held = sum(r["ok"] is True for r in rows)
    failed = sum(r["ok"] is False for r in rows)
    return (
        f"{held} of {len(rows)} rows hold, {failed} fail, {len(rows) - held - failed} "
        f"informational ({results['gpu']}, torch {results['torch']}, {results['date'][:10]})"
    )


if __name__ == "__main__":
    sys.exit(main())
