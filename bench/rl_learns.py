"""GRPO learns, measured: a tiny model taught a toy task's format by SFT, then GRPO
raises its held-out pass rate; and the embedded engine's rollout speed against
transformers' own ``generate``.

    python bench/rl_learns.py                     # both tables (~10 min on 2 shared cores)
    python bench/rl_learns.py --seeds 0 --reps 6  # one GRPO run
    python bench/rl_learns.py --render-docs       # only re-render docs/rl.md

1. Learns (CPU, 2 gloo ranks, the built-in tiny Llama, byte tokenizer, fp32): the
   README's GRPO quick start, run as a user runs it, in a fresh directory:
   ``examples/make_rl_prompts.py`` writes the copy task (400 three-letter words; the
   last 80 held out, and left out of the SFT rows), ``fsdpkit train
   examples/rl_copy_sft.toml`` (30 SFT steps of 16 examples), ``fsdpkit ckpt export
   ... --format hf``, then per ``--seeds`` value ``fsdpkit train
   examples/rl_copy_grpo.toml train.seed=S`` (``model.init_from`` the export; 80 steps
   of 8 prompts x 8 completions, exact reward, stop "\\n"). The held-out pass rate is
   the run's own evaluation (``val_pass_rate``: one completion per held-out prompt,
   temperature 1, seeded per prompt, so evaluations of one seed compare sample for
   sample): "before" is that same evaluation (``fsdpkit.train.stepping.evaluate``
   through ``build_session``, 2 ranks) on the SFT weights, before any GRPO update;
   the rest is what the run logged every 10 steps. Each run's report.html (in
   ``--work``) plots the curve (rl/reward, rl/pass_rate, val_pass_rate, the gap).
2. Rollout tokens/s (one process, one thread): a transformers Llama written by
   ``examples/tiny_hf.py``'s ``write_tiny_model`` (d=256, 4 layers, 8 / 4 heads, vocabulary
   2048), 8 prompts, 8 samples per prompt, 32 new tokens each, temperature 1, no
   top-k / top-p, no stop token (every completion is exactly 32 tokens on both sides,
   checked), one prompt's samples per batch. Rows: ``EmbeddedEngine.generate``
   (fsdpkit's loop: the model's DynamicCache, one Gumbel-max draw per row from that
   completion's own seeded generator, finished rows dropped); transformers'
   ``model.generate`` (its own sampling loop, logits processors, multinomial draw and
   cache, an attention mask); the embedded engine again (the A/A control). Each
   repetition runs every row once, in an order rotated per repetition; ratios are
   per repetition against the first row, median and min-max shown.

Writes bench/results/rl_learns.json (with ``uptime`` before and after) and renders its
block in docs/rl.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import results_io

NAME = "rl_learns"
DOCS = results_io.ROOT / "docs" / "rl.md"
EXAMPLES = results_io.ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))  # tiny_hf
SFT_STEPS = 30
ROLLOUT = {"prompts": 8, "samples": 8, "new_tokens": 32, "temperature": 1.0}
HF_SHAPE = {"dim": 256, "layers": 4, "heads": 8, "kv_heads": 4, "ffn": 688, "vocab_size": 2048}
ROWS = {
    "embedded": "fsdpkit EmbeddedEngine.generate",
    "transformers": "transformers model.generate",
    "embedded-B": "EmbeddedEngine again (A/A control)",
}


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def _fsdpkit(*args: str, cwd: Path) -> float:
    """Run the CLI as a user would; its wall seconds. A failure stops the bench."""
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "fsdpkit", *args], cwd=cwd, capture_output=True, text=True
    )
    if done.returncode:
        raise SystemExit(f"fsdpkit {' '.join(args)} failed:\n{done.stdout[-3000:]}{done.stderr}")
    return time.monotonic() - start


def _held_out(rank: int, world: int, config: str, overrides: list[str]) -> dict[str, float]:
    """The GRPO run's held-out evaluation on its starting weights (no update yet)."""
    from fsdpkit.config import load
    from fsdpkit.runtime.distenv import joined_env
    from fsdpkit.train.session import build_session
    from fsdpkit.train.stepping import evaluate

    del rank
    env = joined_env()
    assert env is not None and env.world_size == world
    values = evaluate(build_session(load(config, overrides), env))
    assert values is not None
    return values


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _grpo(work: Path, *, seed: int, steps: int) -> dict[str, Any]:
    """Before (the SFT weights) and the GRPO run of one seed."""
    from fsdpkit.testing import run_ranks

    config = str(EXAMPLES / "rl_copy_grpo.toml")
    run_dir = work / "runs" / f"rl-copy-grpo-seed{seed}"
    overrides = [
        f"train.seed={seed}",
        f"train.steps={steps}",
        f"data.path={work / 'rl-copy' / 'prompts.jsonl'}",
        f"model.init_from={work / 'rl-copy-sft'}",
    ]
    evaluation = [*overrides, f"logging.run_dir={run_dir}-before"]
    before = run_ranks(_held_out, world_size=2, args=(config, evaluation), timeout_s=600)[0]
    seconds = _fsdpkit("train", config, *overrides, f"logging.run_dir={run_dir}", cwd=work)
    records = _records(run_dir)
    evals = [(0, before["val_pass_rate"])]
    evals += [(r["step"], r["val_pass_rate"]) for r in records if "val_pass_rate" in r]
    train = [r for r in records if "rl/reward" in r]
    data = next(r["data"] for r in records if "data" in r)
    return {
        "seed": seed,
        "prompts": data["prompts"],
        "held_out_prompts": data["held_out_prompts"],
        "held_out_pass_rate": [{"step": s, "pass_rate": p} for s, p in evals],
        "train_reward": [round(r["rl/reward"], 4) for r in train],
        "logprob_gap_max": max(r["rl/logprob_gap_max"] for r in train),
        "grpo_minutes": round(seconds / 60, 2),
        "report": str(run_dir / "report.html"),
    }


def learns(*, work: Path, seeds: list[int], steps: int) -> dict[str, Any]:
    """Table 1: SFT, export, then GRPO per seed, in a fresh ``work`` directory."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    subprocess.run(
        [sys.executable, str(EXAMPLES / "make_rl_prompts.py"), "rl-copy"], cwd=work, check=True
    )
    sft = _fsdpkit("train", str(EXAMPLES / "rl_copy_sft.toml"), cwd=work)
    checkpoint = f"runs/rl-copy-sft/checkpoints/step-{SFT_STEPS:08d}"
    _fsdpkit("ckpt", "export", checkpoint, "--format", "hf", "rl-copy-sft", cwd=work)
    runs = []
    for seed in seeds:
        runs.append(_grpo(work, seed=seed, steps=steps))
        curve = [f"{e['step']}: {e['pass_rate']:.3f}" for e in runs[-1]["held_out_pass_rate"]]
        print(f"seed {seed}: held-out pass rate {', '.join(curve)}", flush=True)
    return {
        "model": "model.preset=tiny, byte-level tokenizer, fp32, 2 gloo ranks",
        "configs": ["examples/rl_copy_sft.toml", "examples/rl_copy_grpo.toml"],
        "sft_steps": SFT_STEPS,
        "sft_minutes": round(sft / 60, 2),
        "runs": runs,
    }


def _prompts(tokenizer: Any) -> list[Any]:
    import numpy as np

    texts = [f"def handler_{i}(request, *args):\n    return" for i in range(ROLLOUT["prompts"])]
    return [np.asarray(tokenizer(t)["input_ids"], dtype=np.int64) for t in texts]


def _rollout_rows(model_dir: Path) -> dict[str, Any]:
    """One callable per row; each returns the tokens it generated."""
    import torch
    import transformers

    from fsdpkit.rollout.embedded import EmbeddedEngine
    from fsdpkit.rollout.sampling import Sampling, completion_seed

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    prompts, g, n = _prompts(tokenizer), ROLLOUT["samples"], ROLLOUT["new_tokens"]
    engine = EmbeddedEngine(model, device=torch.device("cpu"), decode=tokenizer.decode)
    sampling = Sampling(max_new_tokens=n, temperature=ROLLOUT["temperature"])  # no stop ids
    calls = [0]

    def embedded() -> int:
        calls[0] += 1  # new seeds per call: each repetition samples new tokens
        seeds = [[completion_seed(seed=0, step=calls[0], position=p, index=j) for j in range(g)]
                 for p in range(len(prompts))]  # fmt: skip
        groups = engine.generate(prompts, seeds=seeds, sampling=sampling)
        return _counted([len(c.ids) for group in groups for c in group], n)

    config = transformers.GenerationConfig(
        do_sample=True, temperature=ROLLOUT["temperature"], top_k=0, top_p=1.0,
        max_new_tokens=n, eos_token_id=[], pad_token_id=0,
    )  # fmt: skip

    @torch.no_grad()
    def hf() -> int:
        lengths = []
        for prompt in prompts:
            ids = torch.as_tensor(prompt).unsqueeze(0).expand(g, -1).contiguous()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            lengths += [out.shape[1] - ids.shape[1]] * g
        return _counted(lengths, n)

    return {"embedded": embedded, "transformers": hf, "embedded-B": embedded}


def _counted(lengths: list[int], n: int) -> int:
    if any(length != n for length in lengths):
        raise SystemExit(f"a completion was not {n} tokens long: {sorted(set(lengths))}")
    return sum(lengths)


def rollout(*, work: Path, reps: int) -> dict[str, Any]:
    """Table 2: rollout tokens/s, alternating repetitions with an A/A control."""
    import torch
    from tiny_hf import write_tiny_model

    torch.set_num_threads(1)
    model_dir = write_tiny_model(work / "tiny-hf-llama", arch="llama", **HF_SHAPE)
    rows = _rollout_rows(model_dir)
    for fn in rows.values():
        fn()  # warm-up, untimed
    rates: dict[str, list[float]] = {key: [] for key in ROWS}
    keys = list(ROWS)
    for rep in range(reps):
        for key in keys[rep % len(keys) :] + keys[: rep % len(keys)]:
            start = time.perf_counter()
            tokens = rows[key]()
            rates[key].append(tokens / (time.perf_counter() - start))
        print(f"rep {rep + 1}: " + ", ".join(f"{k} {v[-1]:,.0f} tok/s" for k, v in rates.items()))
    out = []
    for key, label in ROWS.items():
        ratios = [a / b for a, b in zip(rates[key], rates["embedded"])]
        out.append({
            "key": key, "row": label, "tokens_per_s": [round(r, 1) for r in rates[key]],
            "median_tokens_per_s": round(statistics.median(rates[key]), 1),
            "ratio": [round(statistics.median(ratios), 3), round(min(ratios), 3),
                      round(max(ratios), 3)],
        })  # fmt: skip
    return {**ROLLOUT, "model": HF_SHAPE, "reps": reps, "threads": 1, "rows": out}


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def render(results: dict[str, Any]) -> str:
    """docs/rl.md's block (tests/unit/test_bench_docs.py checks it)."""
    learned, roll = results["learns"], results["rollout"]
    lines = [
        results_io.provenance(results, NAME),
        "",
        f"Uptime before / after: `{results['uptime'][0]}` / `{results['uptime'][1]}`.",
        "",
        f"**Learns** ({learned['model']}; `{learned['configs'][0]}` for "
        f"{learned['sft_steps']} steps, {learned['sft_minutes']:.1f} min, then "
        f"`{learned['configs'][1]}`): the pass rate on the "
        f"{learned['runs'][0]['held_out_prompts']} held-out words, one completion each at "
        'temperature 1; "before" is the SFT weights:',
        "",
        "| GRPO seed | before | after | held-out pass rate by step | train reward, "
        "first / last 10 steps | largest log-prob gap | GRPO minutes |",
        "| ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in learned["runs"]:
        curve = r["held_out_pass_rate"]
        steps = ", ".join(f"{e['step']}: {_pct(e['pass_rate'])}" for e in curve)
        first, last = r["train_reward"][:10], r["train_reward"][-10:]
        lines.append(
            f"| {r['seed']} | {_pct(curve[0]['pass_rate'])} | {_pct(curve[-1]['pass_rate'])} "
            f"| {steps} | {statistics.mean(first):.3f} / {statistics.mean(last):.3f} "
            f"| {r['logprob_gap_max']:.1e} | {r['grpo_minutes']:.1f} |"
        )
    runs = learned["runs"]
    before = statistics.mean(r["held_out_pass_rate"][0]["pass_rate"] for r in runs)
    after = statistics.mean(r["held_out_pass_rate"][-1]["pass_rate"] for r in runs)
    lines += [
        "",
        f"Mean over {len(runs)} seed(s): held-out pass rate {_pct(before)} before GRPO, "
        f"{_pct(after)} after {len(runs[0]['train_reward'])} steps; the largest log-prob gap "
        f"of any step was {max(r['logprob_gap_max'] for r in runs):.1e} nats (fp32), far "
        "below rl.logprob_gap_max.",
    ]
    m = roll["model"]
    lines += [
        "",
        f"**Rollout tokens/s** (one process, {roll['threads']} thread): transformers Llama "
        f"d={m['dim']}, {m['layers']} layers, vocabulary {m['vocab_size']}; {roll['prompts']} "
        f"prompts x {roll['samples']} samples x {roll['new_tokens']} new tokens, temperature "
        f"{roll['temperature']:g}, {roll['reps']} alternating repetitions:",
        "",
        "| row | what runs | tokens/s (median) | x embedded (median, min-max) |",
        "| --- | --- | ---: | ---: |",
    ]
    what = {
        "embedded": "fsdpkit's loop over the model's DynamicCache; a seeded Gumbel-max draw "
        "per completion",
        "transformers": "transformers' own sampling loop (no logits processor at these "
        "settings), softmax and multinomial draw, its DynamicCache and an attention mask",
        "embedded-B": "the first row again",
    }
    for r in roll["rows"]:
        ratio = r["ratio"]
        lines.append(
            f"| {r['row']} | {what[r['key']]} | {r['median_tokens_per_s']:,.0f} | "
            f"{ratio[0]:.2f} ({ratio[1]:.2f}-{ratio[2]:.2f}) |"
        )
    lines += ["", _verdict(roll["rows"])]
    return "\n".join(lines) + "\n"


def _verdict(rows: list[dict[str, Any]]) -> str:
    """Whether transformers' ratio lies outside the A/A control's span."""
    ratio = {r["key"]: r["ratio"] for r in rows}
    lo, hi = ratio["embedded-B"][1], ratio["embedded-B"][2]
    inside = lo <= ratio["transformers"][0] <= hi
    return (
        f"The A/A control spans {lo:.2f}-{hi:.2f} of the embedded row; transformers' median "
        f"ratio {ratio['transformers'][0]:.2f} lies "
        + (
            "inside it: on this machine the two loops decode at speeds that cannot be told apart."
            if inside
            else "outside it."
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="GRPO train.seed values")
    p.add_argument("--steps", type=int, default=80, help="GRPO steps")
    p.add_argument("--reps", type=int, default=10, help="rollout repetitions (>= 6)")
    p.add_argument("--work", type=Path, default=Path("/tmp/fsdpkit-bench-rl"))
    p.add_argument("--render-docs", action="store_true", help="only re-render docs/rl.md")
    args = p.parse_args()
    if not args.render_docs:
        uptime = [_uptime()]
        learned = learns(work=args.work, seeds=args.seeds, steps=args.steps)
        rolled = rollout(work=args.work, reps=args.reps)
        uptime.append(_uptime())
        seeds = " ".join(map(str, args.seeds))
        results_io.write(
            NAME,
            command=f"python bench/rl_learns.py --seeds {seeds} --steps {args.steps} "
            f"--reps {args.reps}",
            uptime=uptime,
            learns=learned,
            rollout=rolled,
        )
        print(render(results_io.read(NAME)))
    results_io.render_into(DOCS, NAME, render(results_io.read(NAME)))


if __name__ == "__main__":
    main()
