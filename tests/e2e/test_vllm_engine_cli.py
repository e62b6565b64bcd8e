"""rl.engine = vllm through ``fsdpkit train``, as a user runs it: the engines are
processes of the run like its workers (issue 51 item 4).

- kill -9 of the launcher alone: its workers die with it ([Note: worker lifetime]) and
  each worker's engine with its worker ([Note: sidecar processes]): nothing is left;
  while they ran, every listener of the engines was on loopback.
- A model vLLM cannot run (head_dim 16: its CPU attention kernels lack it): exit 2 and
  one paragraph naming the cause and the alternatives, no traceback.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
from clirun import children, fsdpkit, start, wait_for_step

from fsdpkit import netinfo
from vllm_support import SERVER, engine_processes, require_vllm, write_tiny

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _args(tmp: Path, run_dir: Path, *extra: str) -> list[str]:
    data = tmp / "add.jsonl"
    rng = random.Random(0)
    rows = [{"prompt": f"{rng.randint(0, 9)}+{rng.randint(0, 9)}=", "answer": "0"}] * 32
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = tmp / "tiny" if (tmp / "tiny").is_dir() else write_tiny(tmp / "tiny")
    return [
        "train", "--nproc", "2", "train.objective=grpo", f"data.path={data}",
        f"model.hf={model}", f"logging.run_dir={run_dir}", "data.val_fraction=0",
        'rl.rewards=["exact"]', "rl.num_generations=4", "rl.max_completion_length=8",
        "rl.max_prompt_length=8", "train.global_batch_size=8", "train.micro_batch_size=4",
        "train.eval_every=0", "train.sample_tokens=0", "precision.mode=fp32",
        "logging.progress=lines", "logging.report=false", "checkpoint.every=0",
        "checkpoint.resume=never", "rl.engine=vllm", f"rl.vllm_python={require_vllm()}",
        *extra,
    ]  # fmt: skip


def _engines_of(workers: list[int]) -> list[int]:
    found = []
    for worker in workers:
        for pid in children(worker):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            if SERVER.encode() in cmdline:
                found.append(pid)
    return found


def test_a_killed_launcher_takes_its_workers_and_their_engines_along(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start(*_args(tmp_path, run_dir, "train.steps=100000"), cwd=tmp_path)
    try:
        wait_for_step(run_dir, 2, proc, timeout=600)
        workers = children(proc.pid)
        engines = _engines_of(workers)
        assert len(workers) == 2 and len(engines) == 2, (workers, engines)
        found = netinfo.listeners(engines)
        assert all(lst.loopback_only for lst in found), found
        os.kill(proc.pid, signal.SIGKILL)  # the launcher alone, as the OOM killer would
        deadline = time.monotonic() + 15
        alive = [p for p in (*workers, *engines) if Path(f"/proc/{p}").exists()]
        while alive and time.monotonic() < deadline:
            time.sleep(0.2)
            alive = [p for p in alive if _running(p)]
        assert alive == [], "workers or engines outlived their launcher"
        assert engine_processes() == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie is dead, waiting for its reaper


def test_a_model_vllm_cannot_run_stops_the_run_in_one_paragraph(tmp_path: Path) -> None:
    write_tiny(tmp_path / "tiny", dim=64, heads=4, kv_heads=2, ffn=128)  # head_dim 16
    result = fsdpkit(*_args(tmp_path, tmp_path / "run", "train.steps=2"), cwd=tmp_path, timeout=600)
    err = result.stderr
    assert result.returncode == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "vLLM engine did not start: RuntimeError: Unsupported CPU attention configuration: " \
        "head_dim=16" in err, err[-3000:]  # fmt: skip
    assert "supports head_dim 32, 64" in err and "rl.engine = 'embedded'" in err
    assert engine_processes() == []
