"""bench/gpu_check.py off the GPU: it parses, its CPU-side parts run (--dry-run), and
without CUDA it stops with a message that says what to do. Its GPU sections run only
on a lent GPU machine (never in CI)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import gpu_check


def test_help_lists_every_section(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--help"])
    assert stop.value.code == 0
    out = "".join(capsys.readouterr().out.split())  # argparse wraps the list anywhere
    for name in (*gpu_check.IN_PROCESS, *gpu_check.CHILDREN):
        assert name in out


def test_dry_run_plans_and_reads_listeners(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("plan (H200, analytic)") == len(gpu_check.PLAN_ROWS)
    assert "ok    listener reader finds a loopback socket" in out


def test_unknown_section_is_an_error_naming_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--only", "nccl,bogus"])
    assert stop.value.code == 2
    assert "unknown section(s) ['bogus']" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the real run")
def test_without_cuda_it_says_to_run_on_a_gpu_or_dry_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert gpu_check.main([]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device here" in err and "--dry-run" in err
