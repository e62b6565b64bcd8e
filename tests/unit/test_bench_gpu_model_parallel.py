"""bench/gpu_model_parallel.py off a multi-GPU machine: it imports, its row lists are
the layouts the docs name, and with fewer than 2 GPUs it says so in one line and exits
0 (its rows run only on a lent 2+ GPU machine, never in CI)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import gpu_model_parallel  # noqa: E402


def test_rows_cover_each_layout_and_async_tp() -> None:
    two, four = gpu_model_parallel.train_rows(2), gpu_model_parallel.train_rows(4)
    assert list(two) == [
        "fsdp", "tp", "cp", "cp-ring", "pp", "tp-compiled", "tp-async", "moe-fsdp", "moe-ep2"
    ]  # fmt: skip
    assert set(four) - set(two) == {"tpcp"}  # tp2 x cp2 needs 4 ranks
    assert [key for key, (_, _, async_tp) in four.items() if async_tp] == ["tp-async"]
    assert set(gpu_model_parallel.ATTENTION) == {
        "ulysses",
        "fsdpkit-ring",
        "ring-allgather",
        "ring-alltoall",
    }


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="2+ GPUs here: the real run")
def test_fewer_than_two_gpus_prints_one_line_and_exits_0(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert gpu_model_parallel.main([]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "need a machine with 2 or more" in out[0]


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="2+ GPUs here: the real run")
def test_the_script_itself_exits_0_without_two_gpus() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / "gpu_model_parallel.py")],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "nothing measured" in done.stdout
