"""Resuming at another world size keeps the training math (issue 9, failure 12).

With ``train.global_batch_size`` set, a 2-rank run's step-4 checkpoint resumed at 3
ranks, stopped at step 8 and resumed at 4 ranks takes the same 12 sequences per step
as the uninterrupted 2-rank run: every step after a resume matches it within 1e-5
(fp32; only the reduction order differs). The stop at step 8 goes through the real
stop path (the loop's stop flag, as after SIGTERM: agree, checkpoint, return). A
resume with a larger ``train.steps`` applying the new schedule at once:
tests/unit/test_lr_schedule.py; the loader's sequences per step at each world size,
without a process group: tests/unit/test_loader_resume.py.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
from clirun import FAST

from fsdpkit.config import load
from fsdpkit.runtime.distenv import joined_env
from fsdpkit.runtime.rundir import read_jsonl
from fsdpkit.runtime.signals import StopFlag
from fsdpkit.testing import run_ranks
from fsdpkit.train.loop import run
from fsdpkit.train.session import Session, build_session

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

GLOBAL = 12  # splits over 2, 3 and 4 ranks: 2 x (2 x 3), 3 x (1 x 4), 4 x (1 x 3)
BASE = [
    *[a for a in FAST if not a.startswith(("train.steps", "checkpoint.resume"))],
    "train.steps=12",
    "train.warmup_steps=3",
    "train.eval_every=0",
    f"train.global_batch_size={GLOBAL}",
    "precision.mode=fp32",
    "logging.progress=none",
    "checkpoint.every=4",
    "checkpoint.resume=auto",
]


class StopAfter(StopFlag):
    """A stop flag raised once the session has run ``step`` steps (as if SIGTERM
    arrived then): the loop's own stop-and-save path does the rest."""

    def __init__(self, session: Session, step: int) -> None:
        super().__init__()
        self.session, self.step = session, step

    @property  # type: ignore[override]
    def signum(self) -> int | None:
        return int(signal.SIGTERM) if self.session.state.step >= self.step else None

    @signum.setter
    def signum(self, value: int | None) -> None:
        pass


def _segment(rank: int, world: int, overrides: list[str], stop_at: int | None) -> dict:
    env = joined_env()
    assert env is not None and env.world_size == world
    session = build_session(load(None, overrides), env)
    stop = StopAfter(session, stop_at) if stop_at else None
    summary = run(session, stop=stop)
    return {"steps": summary.steps, "stop": summary.stop_signal, "split": session.split}


def _train(world: int, run_dir: Path, *extra: str, stop_at: int | None = None) -> dict:
    overrides = [*BASE, f"logging.run_dir={run_dir}", *extra]
    return run_ranks(_segment, world_size=world, args=(overrides, stop_at), timeout_s=300)[0]


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r}


def test_resume_at_2_then_3_then_4_ranks_continues_the_loss_curve(tmp_path: Path) -> None:
    reference = tmp_path / "ref"
    _train(2, reference, "checkpoint.keep_every=4")  # keeps step 4 for the resume below
    expected = _losses(reference)
    assert sorted(expected) == list(range(1, 13))

    # Step 1-4 at 2 ranks: the reference's own (its step-4 checkpoint and history).
    run_dir = tmp_path / "elastic"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        reference / "checkpoints" / "step-00000004", run_dir / "checkpoints" / "step-00000004"
    )
    history = [r for r in read_jsonl(reference / "metrics.jsonl") if r.get("step", 0) <= 4]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))

    second = _train(3, run_dir, stop_at=8)
    assert (second["steps"], second["stop"]) == (8, signal.SIGTERM)
    assert (second["split"].micro_batch, second["split"].grad_accum) == (4, 1)
    third = _train(4, run_dir)
    assert third["steps"] == 12 and third["split"].global_batch == GLOBAL
    elastic = _losses(run_dir)
    assert sorted(elastic) == list(range(1, 13))  # one history, no step twice
    for step in range(5, 13):
        assert elastic[step] == pytest.approx(expected[step], abs=1e-5), step
