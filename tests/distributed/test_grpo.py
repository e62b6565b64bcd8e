"""GRPO through ``build_session`` + ``run`` (what ``fsdpkit train`` runs) on gloo ranks.

- 2 ranks = 1 process: 5 steps of the same global batch (16 completions, 4 per prompt,
  micro-batches of 4) sample the same completions ([Note: world-size-independent
  samples]: the rewards and completion lengths of every step are equal) and train to the
  same losses, grad norms and final parameters within 1e-5 (fp32); the step-1
  log-prob gap is float noise (<= 1e-5).
- A stale rollout (the engine sampling with the weights from before the last update,
  injected from step 2) stops the run at step 2, naming the gap, with step 1's
  checkpoint kept; so does a corrupted one (one matrix x1.5 while it samples).
- A run resumed from its step-2 checkpoint repeats the uninterrupted run's steps 3-4
  and final parameters bit for bit.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from fsdpkit.config import load
from fsdpkit.rollout.gap import LogprobGapError
from fsdpkit.runtime.distenv import joined_env
from fsdpkit.testing import run_ranks
from fsdpkit.train.loop import run
from fsdpkit.train.session import Session, build_session
from support import full_state

pytestmark = pytest.mark.distributed

STEPS = 5


def _prompts(path: Path) -> Path:
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(64):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    return path


def _overrides(data: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "train.objective=grpo",
        f"data.path={data}",
        f"logging.run_dir={run_dir}",
        "model.preset=tiny",
        "model.dim=64",
        "model.n_layers=2",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.ffn_dim=128",
        "data.seq_len=32",
        "data.val_fraction=0",
        'rl.rewards=["grpo_rewards:digit_share", "exact"]',
        "rl.num_generations=4",
        "rl.max_completion_length=8",
        "rl.max_prompt_length=8",
        'rl.stop=["\\n"]',
        "train.global_batch_size=16",
        "train.micro_batch_size=4",
        f"train.steps={STEPS}",
        "train.lr=3e-3",
        "train.schedule=constant",
        "train.warmup_steps=0",
        "train.eval_every=0",
        "train.sample_tokens=0",
        "train.seed=5",
        "precision.mode=fp32",
        "logging.progress=none",
        "logging.report=false",
        "checkpoint.every=0",
        *extra,
    ]


def _train(rank: int, world: int, overrides: list[str]) -> dict[str, torch.Tensor] | None:
    env = joined_env()
    assert env is not None and env.world_size == world
    session = build_session(load(None, overrides), env)
    run(session)
    params = full_state(session.trainable.model)
    return params if rank == 0 else None


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def test_two_ranks_sample_and_train_as_one_process(tmp_path: Path) -> None:
    data = _prompts(tmp_path / "add.jsonl")
    one = run_ranks(_train, world_size=1, args=(_overrides(data, tmp_path / "one"),))[0]
    two = run_ranks(_train, world_size=2, args=(_overrides(data, tmp_path / "two"),))[0]
    a, b = _steps(tmp_path / "one"), _steps(tmp_path / "two")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    for x, y in zip(a, b):
        for same in ("rl/reward", "rl/completion_len_mean", "rl/rewards/digit_share"):
            assert x[same] == pytest.approx(y[same], abs=1e-6), (x["step"], same)
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], abs=1e-5)
    assert all(r["grad_norm"] > 1e-3 for r in a)  # every step trained on something
    assert a[0]["rl/logprob_gap_max"] <= 1e-5 and b[0]["rl/logprob_gap_max"] <= 1e-5
    worst = max(float((one[k] - two[k]).abs().max()) for k in one)
    assert worst <= 1e-5


def _local(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def _load(model: torch.nn.Module, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            (p.to_local() if isinstance(p, DTensor) else p).copy_(values[n])


def _stale(session: Session) -> Callable[..., Any]:
    """The engine samples with the weights it had at step 1 from step 2 on."""
    engine, model = session.rl.engine, session.trainable.model  # type: ignore[union-attr]
    original, first = engine.generate, {}

    def generate(*args: Any, **kwargs: Any) -> Any:
        if not first:
            first.update(_local(model))
            return original(*args, **kwargs)
        now = _local(model)
        _load(model, first)
        try:
            return original(*args, **kwargs)
        finally:
            _load(model, now)

    return generate


def _corrupted(session: Session) -> Callable[..., Any]:
    """From step 2 on, one matrix is scaled by 1.5 while the engine samples (a sync that
    wrote one tensor wrong)."""
    engine, model = session.rl.engine, session.trainable.model  # type: ignore[union-attr]
    original, calls = engine.generate, [0]
    weight = dict(model.named_parameters())["model.layers.1.mlp.down_proj.weight"]

    def generate(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        local = weight.to_local() if isinstance(weight, DTensor) else weight
        if calls[0] > 1:
            with torch.no_grad():
                local.mul_(1.5)
        try:
            return original(*args, **kwargs)
        finally:
            if calls[0] > 1:
                with torch.no_grad():
                    local.div_(1.5)

    return generate


def _injected(rank: int, world: int, overrides: list[str], kind: str) -> str | None:
    env = joined_env()
    assert env is not None
    session = build_session(load(None, overrides), env)
    session.rl.engine.generate = {"stale": _stale, "corrupted": _corrupted}[kind](session)  # type: ignore[union-attr,method-assign]
    try:
        run(session)
    except LogprobGapError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("kind", ["stale", "corrupted"])
def test_a_bad_engine_update_stops_the_next_step_naming_the_gap(tmp_path: Path, kind: str) -> None:
    data = _prompts(tmp_path / "add.jsonl")
    overrides = _overrides(data, tmp_path / kind, "checkpoint.every=1")  # the default limit
    errors = run_ranks(_injected, world_size=2, args=(overrides, kind))
    assert errors[0] is not None and errors[0] == errors[1]
    assert errors[0].startswith("step 2: the rollout engine (embedded) sampled with other weights")
    assert "rl.logprob_gap_max = 0.001" in errors[0]
    assert "step-00000001" in errors[0]  # the checkpoint a rerun resumes from
    assert [r["step"] for r in _steps(tmp_path / kind)] == [1]  # step 2 never trained
    assert (tmp_path / kind / "checkpoints" / "step-00000001").is_dir()


def test_a_resumed_run_repeats_the_uninterrupted_one_bit_for_bit(tmp_path: Path) -> None:
    data = _prompts(tmp_path / "add.jsonl")
    whole = _overrides(data, tmp_path / "whole", "train.steps=4")
    first = _overrides(data, tmp_path / "parts", "train.steps=2", "checkpoint.every=2")
    rest = _overrides(data, tmp_path / "parts", "train.steps=4", "checkpoint.every=2")
    full = run_ranks(_train, world_size=2, args=(whole,))[0]
    run_ranks(_train, world_size=2, args=(first,))
    resumed = run_ranks(_train, world_size=2, args=(rest,))[0]
    a = {r["step"]: r for r in _steps(tmp_path / "whole")}
    b = {r["step"]: r for r in _steps(tmp_path / "parts")}
    for step in (3, 4):
        for key in ("loss", "grad_norm", "rl/reward", "rl/completion_len_mean"):
            assert a[step][key] == b[step][key], (step, key)
    assert all(torch.equal(full[k], resumed[k]) for k in full)


def _lora(rank: int, world: int, overrides: list[str]) -> list[str]:
    env = joined_env()
    assert env is not None
    session = build_session(load(None, overrides), env)
    run(session)
    return sorted(n for n, p in session.trainable.model.named_parameters() if p.requires_grad)


def test_lora_with_a_kl_term_trains_the_adapters_and_saves_only_them(tmp_path: Path) -> None:
    """Under LoRA the reference is the base with the adapters off ([Note: reference
    model]): the KL starts at 0 and grows as the adapters move; the checkpoint holds the
    adapters only, and exports as a peft adapter."""
    import torch.distributed.checkpoint as dcp
    from tiny_hf import write_tiny_model

    from fsdpkit.export import export

    model_dir = write_tiny_model(tmp_path / "tiny", arch="llama", vocab_size=320)
    data = _prompts(tmp_path / "add.jsonl")
    overrides = _overrides(
        data, tmp_path / "lora", f"model.hf={model_dir}", "lora.rank=4", "lora.alpha=8",
        "rl.beta=0.04", "train.steps=3", "train.lr=1e-2", "checkpoint.every=3",
        "checkpoint.adapters_only=true",
    )  # fmt: skip
    overrides = [o for o in overrides if not o.startswith("model.") or o.startswith("model.hf")]
    trained = run_ranks(_lora, world_size=2, args=(overrides,))[0]
    assert trained and all("lora_" in n for n in trained)
    steps = _steps(tmp_path / "lora")
    assert steps[0]["rl/kl"] == 0.0 and steps[-1]["rl/kl"] > 0.0
    step_dir = tmp_path / "lora" / "checkpoints" / "step-00000003"
    saved = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    weights = [k for k in saved if k.startswith("app.model.")]
    assert weights and all("lora_" in k for k in weights)
    export(step_dir, tmp_path / "adapter", fmt="peft")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["grad_op", "replicate", "hybrid"])
def test_every_data_parallel_strategy_trains_as_full_shard(tmp_path: Path, strategy: str) -> None:
    data = _prompts(tmp_path / "add.jsonl")
    base = run_ranks(_train, world_size=2, args=(_overrides(data, tmp_path / "full"),))[0]
    other = _overrides(data, tmp_path / strategy, f"parallel.strategy={strategy}")
    if strategy == "hybrid":
        other.append("parallel.shard_degree=1")
    params = run_ranks(_train, world_size=2, args=(other,))[0]
    for x, y in zip(_steps(tmp_path / "full"), _steps(tmp_path / strategy)):
        assert x["rl/reward"] == pytest.approx(y["rl/reward"], abs=1e-6)
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5)
    assert max(float((base[k] - params[k]).abs().max()) for k in base) <= 1e-5
