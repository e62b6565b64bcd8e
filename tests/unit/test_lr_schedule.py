"""The learning-rate schedule (fsdpkit.trainable.optim): warm-up and decay to the floor,
and a resume that applies a changed schedule from its first step
(fsdpkit.train.loop.reapply_schedule)."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from fsdpkit.config import TrainConfig
from fsdpkit.train.loop import reapply_schedule
from fsdpkit.trainable.optim import build_scheduler, lr_factor


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_lr_schedule_warms_up_then_decays_to_the_floor(schedule: str) -> None:
    cfg = TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1, schedule=schedule)  # type: ignore[arg-type]
    factors = [lr_factor(step, cfg) for step in range(100)]
    assert factors[:10] == pytest.approx([(i + 1) / 10 for i in range(10)])
    assert factors[10] == pytest.approx(1.0)
    if schedule == "constant":
        assert set(factors[10:]) == {1.0}
        return
    assert all(a >= b for a, b in itertools.pairwise(factors[10:]))  # monotone decay
    assert lr_factor(100, cfg) == pytest.approx(0.1) and lr_factor(500, cfg) == pytest.approx(0.1)
    middle = lr_factor(55, cfg)
    expected = 0.1 + 0.9 * (0.5 if schedule == "linear" else 0.5 * (1 + math.cos(math.pi / 2)))
    assert middle == pytest.approx(expected)


def test_lr_schedule_without_warmup_starts_at_the_peak() -> None:
    assert lr_factor(0, TrainConfig(steps=10, warmup_steps=0)) == pytest.approx(1.0)


def _resumed(steps_before: int, steps_after: int, at: int) -> tuple[float, float]:
    """(LR the resumed run's first step uses, LR the new schedule gives there)."""
    model = torch.nn.Linear(2, 2)
    old = TrainConfig(steps=steps_before, warmup_steps=2)
    opt = torch.optim.AdamW(model.parameters(), lr=old.lr)
    sched = build_scheduler(opt, old)
    for _ in range(at):
        opt.step()
        sched.step()
    saved = (opt.state_dict(), sched.state_dict())
    new = TrainConfig(steps=steps_after, warmup_steps=2)
    opt2 = torch.optim.AdamW(model.parameters(), lr=new.lr)
    sched2 = build_scheduler(opt2, new)
    opt2.load_state_dict(saved[0])
    sched2.load_state_dict(saved[1])
    session = SimpleNamespace(
        scheduler=sched2, trainable=SimpleNamespace(optimizer=opt2), cfg=SimpleNamespace(train=new)
    )
    reapply_schedule(session)  # type: ignore[arg-type]
    assert sched2.get_last_lr()[0] == opt2.param_groups[0]["lr"]
    return opt2.param_groups[0]["lr"], new.lr * lr_factor(at, new)


def test_a_resume_applies_the_new_schedule_from_its_first_step() -> None:
    used, wanted = _resumed(12, 16, at=12)
    assert used == wanted and used != TrainConfig().lr * lr_factor(12, TrainConfig(steps=12))
    same, _ = _resumed(12, 12, at=7)  # unchanged schedule: bit-identical to not resuming
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=TrainConfig().lr)
    sched = build_scheduler(opt, TrainConfig(steps=12, warmup_steps=2))
    for _ in range(7):
        opt.step()
        sched.step()
    assert same == opt.param_groups[0]["lr"]
