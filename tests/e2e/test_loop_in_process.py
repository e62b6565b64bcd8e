"""The training loop is a library: ``train.loop.run`` on a session built in-process
under ``fsdpkit.testing.run_ranks`` trains exactly as ``fsdpkit train`` does."""

from __future__ import annotations

from pathlib import Path

import pytest
from clirun import FAST, fsdpkit, losses

from fsdpkit.config import load
from fsdpkit.runtime.distenv import joined_env
from fsdpkit.testing import run_ranks
from fsdpkit.train.loop import run
from fsdpkit.train.session import build_session

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]


def _train_in_process(rank: int, world: int, overrides: list[str]) -> list[float]:
    env = joined_env()  # run_ranks sets RANK / WORLD_SIZE like torchrun
    assert env is not None and env.world_size == world
    summary = run(build_session(load(None, overrides), env))
    assert summary.steps == 12
    return [summary.final_loss or 0.0]


def test_loop_in_process_equals_the_cli_run(tmp_path: Path) -> None:
    cli = fsdpkit("train", *FAST, f"logging.run_dir={tmp_path / 'cli'}", cwd=tmp_path)
    assert cli.returncode == 0, cli.stderr[-3000:]
    overrides = [*FAST, f"logging.run_dir={tmp_path / 'lib'}", "logging.progress=none"]
    final = run_ranks(_train_in_process, world_size=2, args=(overrides,), timeout_s=300)
    assert losses(tmp_path / "lib") == losses(tmp_path / "cli")
    assert final[0] == final[1] == [losses(tmp_path / "cli")[-1]]
