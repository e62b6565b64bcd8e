"""``fsdpkit train`` with compiled blocks and selective checkpointing, as a user runs it:
compile time is reported apart from step time (metrics.jsonl ``compile_s``, the
summary's "compile time" row) and kept out of tokens/s."""

from __future__ import annotations

from pathlib import Path

import pytest
from clirun import FAST, fsdpkit, metrics

from support import needs_cxx

pytestmark = pytest.mark.e2e


@needs_cxx
@pytest.mark.slow
def test_compile_time_is_reported_apart(tmp_path: Path) -> None:
    result = fsdpkit(
        "train",
        *FAST,
        "train.steps=4",
        "train.eval_every=0",
        "train.compile=true",
        "activations.mode=selective",
        f"logging.run_dir={tmp_path / 'run'}",
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [r for r in metrics(tmp_path / "run") if "loss" in r]
    first, rest = records[0], records[1:]
    assert 0 < first["compile_s"] < first["step_time_s"]
    tokens = 2 * 4 * 64  # world 2 x micro-batch 4 x seq 64
    without = tokens / (first["step_time_s"] - first["compile_s"])
    assert first["tokens_per_s"] == pytest.approx(without, rel=1e-6)
    assert all(r["compile_s"] == 0 for r in rest)
    assert "compile time" in result.stdout and "selective activation" in result.stdout
