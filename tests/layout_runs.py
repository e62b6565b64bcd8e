"""Runs of the real trainer (``build_session`` + ``train.loop.run``: what ``fsdpkit
train`` runs) at N gloo ranks, for the parity tests of parallel layouts: a run's
metrics and final parameters, the same config in one process, and runs resumed from a
checkpoint of another layout.

A run writes ``metrics.jsonl`` under its run directory; the parameters come back from
every rank (under pp each rank holds its stages' only: they are compared by name).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from fsdpkit.config import load
from fsdpkit.runtime.distenv import joined_env
from fsdpkit.testing import run_ranks
from fsdpkit.train.loop import run
from fsdpkit.train.session import build_session
from support import full_state

TOL = 1e-5
"""Losses, grad norms and final parameters against one process (fp32)."""
RESUMED = 1e-6
"""The next losses of a resumed run against the run that went on, relative."""


def _train(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    env = joined_env()
    assert env is not None and env.world_size == world
    session = build_session(load(None, overrides), env)
    run(session)
    trainable = session.trainable
    pipeline = trainable.pipeline
    plans = pipeline.plans if pipeline is not None else [trainable.plan]
    return {
        "params": full_state(trainable.model),
        "plan": "\n".join(p.describe() for p in plans),
        "loss_note": trainable.loss_note or "",
    }


def metrics(run_dir: Path) -> dict[str, list[float]]:
    """The run's logged losses, grad norms and router losses, step by step."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    keys = ("loss", "grad_norm", "aux_loss")
    return {key: [r[key] for r in records if key in r] for key in keys}


def train(run_dir: Path, overrides: list[str], *, world: int) -> list[dict[str, Any]]:
    """Every rank's result of training ``overrides`` at ``world`` ranks in ``run_dir``."""
    args = ([*overrides, f"logging.run_dir={run_dir}"],)
    return run_ranks(_train, world_size=world, args=args, timeout_s=900)


def resume(
    straight: Path, into: Path, overrides: list[str], *, step: int, last: int, world: int
) -> list[float]:
    """The losses after ``step`` of ``straight`` resumed from its checkpoint of ``step``
    under ``overrides`` (another layout) at ``world`` ranks, up to step ``last``."""
    shutil.copytree(straight, into)
    for saved in (into / "checkpoints").glob("step-*"):
        if int(saved.name.removeprefix("step-")) > step:
            shutil.rmtree(saved)
    train(into, [*overrides, "checkpoint.resume=auto"], world=world)
    losses = metrics(into)["loss"][step:]
    assert len(losses) == last - step, losses
    return losses


def worst(got: list[dict[str, Any]], want: dict[str, Any]) -> dict[str, float]:
    """The largest difference of each parameter over the ranks holding it, checking that
    every one of ``want``'s parameters is held somewhere (and nothing else)."""
    names: set[str] = set()
    far: dict[str, float] = {}
    for out in got:
        names.update(out["params"])
        for key, value in out["params"].items():
            diff = float((value - want["params"][key]).abs().max())
            far[key] = max(far.get(key, 0.0), diff)
    assert names == set(want["params"]), names ^ set(want["params"])
    return far


def assert_trains_as_one_process(
    got: list[dict[str, Any]], got_metrics: dict[str, list[float]], want: dict[str, Any]
) -> dict[str, float]:
    """Losses, grad norms (absolute) and final parameters within ``TOL``; returns the
    largest differences (for the report)."""
    out = {}
    for key in ("loss", "grad_norm"):
        a, b = torch.tensor(got_metrics[key]), torch.tensor(want["metrics"][key])
        assert a.shape == b.shape, (key, got_metrics[key], want["metrics"][key])
        out[key] = float((a - b).abs().max())
        assert out[key] <= TOL, (key, got_metrics[key], want["metrics"][key])
    far = worst(got, want)
    out["params"] = max(far.values())
    bad = {k: v for k, v in far.items() if v > TOL}
    assert not bad, bad
    return out


def assert_same_next_losses(got: list[float], want: list[float]) -> float:
    """Within ``RESUMED`` relative; returns the largest relative difference."""
    rel = [abs(a - b) / abs(b) for a, b in zip(got, want, strict=True)]
    assert max(rel) <= RESUMED, (got, want)
    return max(rel)
