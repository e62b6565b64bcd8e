"""The planner's GRPO phases against the true per-rank peaks of real GRPO steps.

Each configuration builds a GRPO session on 2 gloo ranks (``build_session``, what
``fsdpkit train`` builds), runs one step (AdamW's states appear) and then measures
``STEPS`` more with c10's process-wide count ([Note: measuring CPU peaks]), split
into the rollout and the training phase at ``sample``'s call (a marker allocation of
an odd size on either side). Every prompt has exactly ``rl.max_prompt_length`` tokens
and the stop tokens are taken away, so every completion runs to
``rl.max_completion_length``: the case the plan plans ([Note: rollout memory]).

The configurations put the rollout's peak at each of its moments (the last decode
step's full KV cache, a prefill block, the first token draw), one makes the rollout
the step's peak, and together they cover GRPO's loss head in fp32 and bf16, the KL
reference (a sharded copy; LoRA's adapters off), top-k / top-p / temperature,
accumulation, and a transformers model (its DynamicCache, SDPA's grouped heads, an
untied head).

Measured on 2026-12-07 (2 steps each, identical on every step and rank): rollout
within 0.06% (-0.06% at a prefill block, the rest within 0.02%), training within
0.08%, of the quiet step. ``BOUND`` is 0.2%, the analytic planner's bound of
tests/distributed/test_planner_accuracy.py: these peaks repeat to the byte, so it
leaves about twice the worst error for the allocator's rounding, and the gather's
gloo temporaries (thread timing: ``spread``) are bounded separately.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_hf import write_tiny_model, write_tokenizer

from fsdpkit.config import load
from fsdpkit.cpumem import _profiled, enable_process_wide_accounting, live_bytes
from fsdpkit.planner import plan
from fsdpkit.runtime.distenv import joined_env
from fsdpkit.runtime.hangs import HangProbe
from fsdpkit.testing import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 2
BOUND = 0.002
BEFORE, AFTER = 4099, 4111
"""Marker allocations (uint8 elements) around ``sample``: sizes no step allocates."""

TINY = [
    "model.preset=tiny", "model.dim=128", "model.n_layers=2", "model.n_heads=4",
    "model.n_kv_heads=2", "model.ffn_dim=344",
]  # fmt: skip
G8 = ["train.global_batch_size=16", "train.micro_batch_size=8"]
"""Groups of 8: one prompt per rank per step, one micro-batch."""
SMALL = [*TINY[:1], "model.dim=64", *TINY[2:5], "model.ffn_dim=128"]
CASES: dict[str, tuple[str, list[str]]] = {
    # (tokenizer: "bytes", "bpe" (4096) or "hf" (the model directory's, 2048), overrides)
    "kv cache": ("bytes", [*TINY, "rl.num_generations=8", "rl.max_prompt_length=8",
                           "rl.max_completion_length=120", *G8]),
    "prefill block": ("bytes", [*TINY, "rl.num_generations=8", "rl.max_prompt_length=64",
                                "rl.max_completion_length=64", *G8]),
    "kl + top-p": ("bpe", [*SMALL, "rl.beta=0.04", "rl.temperature=0.7", "rl.top_p=0.9",
                           "rl.top_k=50", "rl.max_completion_length=16"]),
    "lora kl accum": ("bpe", [*SMALL, "lora.rank=8", "rl.beta=0.04", "train.micro_batch_size=2",
                              "train.global_batch_size=16", "rl.num_iterations=2"]),
    # the rollout, not the training step, is the step's peak: 32 rows, micro-batches of 1
    "rollout peaks": ("bytes", [*TINY, "rl.num_generations=32", "rl.max_prompt_length=8",
                                "rl.max_completion_length=120", "train.global_batch_size=64",
                                "train.micro_batch_size=1", "activations.mode=full"]),
    "hf bf16": ("hf", ["precision.mode=bf16", "rl.max_prompt_length=8",
                       "rl.max_completion_length=56", "rl.num_generations=8", *G8]),
}  # fmt: skip


def _base(root: Path, name: str, tokenizer: str) -> list[str]:
    """The run's settings around a case: one prompt per rank per step unless a case
    says otherwise, G = 4, prompt 32 + completion 32 tokens."""
    run = root / name.replace(" ", "-")
    run.mkdir(parents=True, exist_ok=True)
    model = [f"model.hf={root / 'hf'}"] if tokenizer == "hf" else []
    tok = [f"data.tokenizer={root / 'bpe'}"] if tokenizer == "bpe" else []
    return [
        "train.objective=grpo", f"data.path={root / f'{tokenizer}-{name}.jsonl'}",
        f"logging.run_dir={run}", *model, *tok, 'rl.rewards=["exact"]',
        "rl.num_generations=4", "rl.max_prompt_length=32", "rl.max_completion_length=32",
        "train.global_batch_size=8", "train.micro_batch_size=4", "precision.mode=fp32",
        "data.val_fraction=0", "train.steps=10", "train.eval_every=0", "train.sample_tokens=0",
        "logging.progress=none", "logging.report=false", "checkpoint.every=0",
    ]  # fmt: skip


def _prompts(path: Path, *, tokenizer: Path | None, length: int) -> None:
    """64 prompts of exactly ``length`` tokens (the byte tokenizer: characters)."""
    rng, rows = random.Random(0), []
    if tokenizer is None:
        rows = ["".join(rng.choice("0123456789+") for _ in range(length)) for _ in range(64)]
    else:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
        while len(rows) < 64:  # decoded ids that encode back to as many tokens
            text = tok.decode([rng.randrange(1, tok.get_vocab_size()) for _ in range(length)])
            if len(tok.encode(text).ids) == length:
                rows.append(text)
    path.write_text("".join(json.dumps({"prompt": r, "answer": "1"}) + "\n" for r in rows))


def _config(root: Path, name: str) -> list[str]:
    tokenizer, extra = CASES[name]
    overrides = [*_base(root, name, tokenizer), *extra]
    length = int(
        next(o for o in reversed(overrides) if o.startswith("rl.max_prompt_length=")).split("=")[1]
    )
    source = {"bytes": None, "bpe": root / "bpe", "hf": root / "hf"}[tokenizer]
    _prompts(root / f"{tokenizer}-{name}.jsonl", tokenizer=source, length=length)
    return overrides


def _phases(
    rank: int, world: int, configs: dict[str, list[str]]
) -> dict[str, list[tuple[int, int]]]:
    """run_ranks worker: per configuration, per measured step, (rollout peak, training
    peak) minus what the rank held before the session was built."""
    from fsdpkit.train import stepping
    from fsdpkit.train.session import build_session

    enable_process_wide_accounting()
    env = joined_env()
    assert env is not None
    original, out = stepping.sample, {}

    def marked(rl: Any, cfg: Any, batch: Any, *, step: int) -> Any:
        want = cfg.rl.max_prompt_length
        assert all(len(ids) == want for ids in batch.ids), "prompts of the planned length"
        torch.empty(BEFORE, dtype=torch.uint8)
        rollout = original(rl, cfg, batch, step=step)
        torch.empty(AFTER, dtype=torch.uint8)
        return rollout

    stepping.sample = marked
    for name, overrides in configs.items():
        base = live_bytes()
        s = build_session(load(None, overrides), env)
        assert s.rl is not None
        s.rl.sampling = dataclasses.replace(s.rl.sampling, stop_ids=frozenset(), stop_strings=())
        stepping.grpo_step(s, s.rl, HangProbe.off())  # AdamW's states appear
        out[name] = [_measured(s, base) for _ in range(STEPS)]
        del s
    return out


def _measured(s: Any, base: int) -> tuple[int, int]:
    """One GRPO step's (rollout, training) peaks above ``base``."""
    from fsdpkit.train import stepping

    events = _profiled(lambda: stepping.grpo_step(s, s.rl, HangProbe.off()))
    first = next(i for i, e in enumerate(events) if e[2] == BEFORE)
    last = next(i for i, e in enumerate(events) if e[2] == AFTER)
    rollout = max(total for _, total, _ in events[first:last])
    training = max(total for _, total, _ in events[last:])
    return rollout - base, training - base


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("grpo-plan")
    (root / "bpe").mkdir()
    write_tokenizer(root / "bpe", vocab_size=4096)
    write_tiny_model(root / "hf", arch="llama", dim=64, layers=2, heads=4, kv_heads=2, ffn=128,
                     vocab_size=2048, max_positions=256)  # fmt: skip
    return root


@pytest.fixture(scope="module")
def measured(root: Path) -> dict[str, list[tuple[int, int]]]:
    configs = {name: _config(root, name) for name in CASES}
    ranks = run_ranks(_phases, world_size=2, args=(configs,), timeout_s=900)
    return {  # each step's peaks over the ranks
        name: [tuple(max(r[name][i][k] for r in ranks) for k in (0, 1)) for i in range(STEPS)]  # type: ignore[misc]
        for name in CASES
    }


@pytest.mark.parametrize("name", list(CASES))
def test_the_plan_matches_each_phase_of_a_real_grpo_step(
    measured: dict[str, list[tuple[int, int]]], root: Path, name: str
) -> None:
    p = plan(load(None, _config(root, name)), world_size=2, trace=False)
    assert p.grpo is not None and p.grpo.rollout is not None
    rollout, training = p.grpo.rollout, p.grpo.training
    quiet = [min(step[k] for step in measured[name]) for k in (0, 1)]
    worst = [max(step[k] for step in measured[name]) for k in (0, 1)]
    errors = (rollout.peak / quiet[0] - 1, training.bytes / quiet[1] - 1)
    detail = (name, rollout.where, f"rollout {errors[0]:+.3%}", f"training {errors[1]:+.3%}")
    assert abs(errors[0]) <= BOUND and abs(errors[1]) <= BOUND, detail
    assert worst[0] <= rollout.peak + rollout.spread, (detail, worst)
    assert p.memory.peak.bytes == max(rollout.peak, training.bytes)
    if name == "rollout peaks":
        assert p.grpo.peak_phase == "rollout" and p.memory.peak.phase == "rollout"
