"""Hang triage through the CLI (issue 14): one rank falls asleep inside step 3.

Two runs at once (they mostly wait, so they share the 2 cores well), one per way a
hang is noticed: the launcher's stall watch (``parallel.hang_timeout_s``, set well
below the collective timeout so that it, not the timeout, fires) and a collective
timeout (``parallel.timeout_s``, stall watch off). Each must name rank 1 and its
sleeping frame within its timeout plus a few seconds, exit non-zero with one
paragraph, and leave no process behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from clirun import FAST, processes_in, start

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TIMEOUT_S = 10.0
STALL_S = 6.0
SLACK_S = 5.0
"""Report no later than timeout + this after the rank fell asleep."""
ARGS = [
    *[a for a in FAST if not a.startswith(("train.steps", "train.eval_every"))],
    "train.steps=8",
    "train.eval_every=0",
    "logging.progress=none",
    "model.factory=factories:hanging",
    f"parallel.timeout_s={TIMEOUT_S:g}",
]


def _launch(tmp_path: Path, name: str, *extra: str) -> tuple[subprocess.Popen[str], Path, Path]:
    run_dir, mark = tmp_path / name, tmp_path / f"{name}.asleep"
    env = {"FSDPKIT_TEST_HANG_RANK": "1", "FSDPKIT_TEST_HANG_MARK": str(mark)}
    proc = start("train", *ARGS, *extra, f"logging.run_dir={run_dir}", cwd=tmp_path, env=env)
    return proc, run_dir, mark


def _check(
    proc: subprocess.Popen[str],
    run_dir: Path,
    mark: Path,
    *,
    trigger: str,
    within_s: float,
    state: str,
    analyze: bool = False,
) -> None:
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 1, err[-3000:]
    report = run_dir / "hang" / "report.txt"
    # One paragraph: the trigger, the rank behind and its frame, the report file.
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert trigger in err and "Rank 1 is behind" in err and str(report) in err, err
    assert "factories.py" in err and "in asleep_inside_a_step" in err, err
    assert "rank 0 waits in collective" in err and "which rank 1" in err, err

    asleep = float(mark.read_text())
    assert report.stat().st_mtime - asleep <= within_s + SLACK_S

    data = json.loads((run_dir / "hang" / "report.json").read_text())
    assert data["behind"] == [1]
    ranks = {r["rank"]: r for r in data["ranks"]}
    assert ranks[1]["main_thread"][0].endswith("in asleep_inside_a_step")
    assert ranks[1]["phase"] == "forward" and ranks[1]["step"] == 2
    waiting = ranks[0]["last_collectives"][0]
    assert waiting["op"] == "gloo:all_gather" and waiting["state"] == state
    assert ranks[0]["collectives_issued"]["0"] == ranks[1]["collectives_issued"]["0"] + 1
    assert "asleep_inside_a_step" in ranks[1]["stacks"]  # faulthandler, every thread
    text = report.read_text()
    assert "== rank 0" in text and "== rank 1" in text and "issued from" in text
    recorder = run_dir / "hang" / "flight-recorder"
    assert sorted(p.name for p in recorder.iterdir()) == ["rank_0", "rank_1"]
    if analyze:  # torch's own analyzer reads the dumps and finds the rank that never came
        out = subprocess.run(
            [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(recorder)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # its findings go to a logger on stderr
            text=True,
            timeout=120,
        ).stdout
        assert "missing ranks: {1}" in out and "collective: gloo:all_gather" in out, out[-2000:]

    deadline = time.monotonic() + 5
    while processes_in(run_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes_in(run_dir), "a worker of the hung run is still alive"


def test_a_rank_asleep_in_a_step_is_named_with_its_stack_by_both_triggers(
    tmp_path: Path, launched: list[subprocess.Popen[str]]
) -> None:
    stall, stall_dir, stall_mark = _launch(tmp_path, "stall", f"parallel.hang_timeout_s={STALL_S}")
    timeout, timeout_dir, timeout_mark = _launch(tmp_path, "timeout", "parallel.hang_timeout_s=0")
    launched += [stall, timeout]
    _check(
        stall,
        stall_dir,
        stall_mark,
        trigger="no rank made progress for",
        within_s=STALL_S,
        state="not completed",
        analyze=True,
    )
    _check(
        timeout,
        timeout_dir,
        timeout_mark,
        trigger="a collective of rank 0 timed out after 10 s",
        within_s=TIMEOUT_S,
        state="timed out",
    )
