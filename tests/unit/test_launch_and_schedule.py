"""The launcher's choice of the error to show, and the learning-rate schedule."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from fsdpkit.config import TrainConfig
from fsdpkit.runtime.failures import root_cause
from fsdpkit.trainable.optim import lr_factor


def _record(directory: Path, *, rank: int, attempt: int, time: float, message: str) -> None:
    record = {"rank": rank, "attempt": attempt, "time": time, "user": False, "message": message}
    (directory / f"rank-{rank}-attempt-{attempt}.json").write_text(json.dumps(record))


def test_root_cause_is_the_first_primary_error_of_the_last_attempt(tmp_path: Path) -> None:
    assert root_cause(tmp_path) is None
    _record(tmp_path, rank=0, attempt=0, time=1.0, message="ValueError: bad batch")
    _record(tmp_path, rank=1, attempt=1, time=5.0, message="Connection reset by peer")
    _record(tmp_path, rank=0, attempt=1, time=6.0, message="RuntimeError: shape mismatch")
    _record(tmp_path, rank=2, attempt=1, time=7.0, message="KeyError: 'x'")
    (tmp_path / "rank-3-attempt-1.json").write_text("{torn")  # skipped, not fatal
    cause = root_cause(tmp_path)
    assert cause is not None and cause["rank"] == 0 and "shape mismatch" in str(cause["message"])


def test_root_cause_falls_back_to_the_earliest_secondary_error(tmp_path: Path) -> None:
    _record(tmp_path, rank=1, attempt=0, time=2.0, message="gloo: connection closed by peer")
    _record(tmp_path, rank=0, attempt=0, time=1.0, message="Socket Timeout")
    cause = root_cause(tmp_path)
    assert cause is not None and cause["rank"] == 0


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
