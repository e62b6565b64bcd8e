"""Run the ``fsdpkit`` CLI as a user would: a subprocess with a hard timeout."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
EXAMPLES = HERE.parents[1] / "examples"
"""examples/: tiny_hf, which factories build their tiny transformers models with."""


def cli_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a CLI run: tests/e2e, tests and examples on PYTHONPATH
    (factories), no inherited launcher variables."""
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), str(HERE.parent), str(EXAMPLES), *filter(None, [full_env.get("PYTHONPATH")])]
    )
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        full_env.pop(key, None)
    return full_env


def fsdpkit(
    *args: str, cwd: Path, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m fsdpkit *args``, waiting for it."""
    return subprocess.run(
        [sys.executable, "-m", "fsdpkit", *args],
        cwd=cwd,
        env=cli_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``python -m fsdpkit *args`` in the background (run independent commands at once),
    in a session of its own: a test can signal or kill its process group as a terminal
    or a scheduler would."""
    return subprocess.Popen(
        [sys.executable, "-m", "fsdpkit", *args],
        cwd=cwd,
        env=cli_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for_step(
    run_dir: Path, step: int, proc: subprocess.Popen[str], *, timeout: float = 180
) -> int:
    """Wait until metrics.jsonl logs ``step`` or later; the step seen."""
    deadline = time.monotonic() + timeout
    path = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists():
            lines = path.read_text().splitlines()
            try:
                seen = int(json.loads(lines[-1]).get("step", 0)) if lines else 0
            except ValueError:  # a line being written
                seen = 0
            if seen >= step:
                return seen
        time.sleep(0.02)
    raise AssertionError(f"run did not reach step {step}: exit {proc.poll()}")


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (the launcher's workers)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def processes_in(run_dir: Path) -> list[int]:
    """Live processes whose command line names ``run_dir`` (launcher and workers)."""
    needle = str(run_dir).encode()
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if needle in Path(f"/proc/{entry}/cmdline").read_bytes():
                    out.append(int(entry))
    return out


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Per-step training records of a run (evaluation records left out)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in metrics(run_dir)]


# Small and fast: the tests check behaviour, not learning quality.
FAST = [
    "train.steps=12",
    "train.eval_every=6",
    "train.sample_tokens=0",
    "data.max_bytes=300000",
    "data.seq_len=64",
    "model.n_layers=2",
    "model.dim=64",
    "model.ffn_dim=128",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "checkpoint.resume=never",
    "logging.report=false",  # ~3 s of plotting per run; test_observe_cli covers reports
]
