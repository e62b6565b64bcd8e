"""The trainer / vLLM engine plumbing without an engine: the wire (framed messages,
shared-memory buckets seen by two processes), the failure paragraphs, stop strings,
the KV cache size, and the sidecar's environment."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from fsdpkit.planner.replay.vllmmem import BLOCK, MIB, kv_cache_bytes
from fsdpkit.rollout.vllm.engine import stop_string_end
from fsdpkit.rollout.vllm.process import EngineProcess, EngineSpec, VllmEngineError, last_exception
from fsdpkit.rollout.vllm.wire import ALIGN, EngineGone, SharedBucket, recv, send
from fsdpkit.runtime import sidecar


def test_messages_round_trip_and_eof_is_engine_gone() -> None:
    a, b = socket.socketpair()
    payload = {"prompts": [[1, 2, 3]], "seeds": [[2**62]], "text": "x" * 3_000_000}
    sender = threading.Thread(target=send, args=(a, "generate", payload))
    sender.start()  # larger than the socket's buffer: sent while the other end reads
    assert recv(b) == ("generate", payload)
    sender.join()
    a.close()
    with pytest.raises(EngineGone):
        recv(b)


def test_a_bucket_is_seen_by_another_process_and_keeps_tensors_aligned() -> None:
    bucket = SharedBucket.create(1 << 16)
    tensors = {
        "a": torch.arange(7, dtype=torch.float32),
        "b": torch.randn(3, 5).to(torch.bfloat16),
        "c": torch.randn(2, 3, 4, dtype=torch.float16),
    }
    for name, t in tensors.items():
        assert bucket.fits(t.numel() * t.element_size())
        bucket.put(name, t)
    assert all(s.offset % ALIGN == 0 for s in bucket.slots)
    slots = [s.as_tuple() for s in bucket.slots]
    code = (
        "import sys, torch\n"
        "from fsdpkit.rollout.vllm.wire import SharedBucket, Slot\n"
        f"b = SharedBucket.attach({bucket.fd}, {bucket.size})\n"
        f"for raw in {slots!r}:\n"
        "    s = Slot(*raw); t = b.view(s)\n"
        "    print(s.name, t.dtype, tuple(t.shape), float(t.double().sum()))\n"
        "    t.zero_()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], pass_fds=(bucket.fd,), capture_output=True, text=True,
        env=os.environ | {"PYTHONPATH": str(Path(__file__).parents[2] / "src")}, check=True,
    )  # fmt: skip
    lines = out.stdout.splitlines()
    for line, (name, t) in zip(lines, tensors.items()):
        assert line.startswith(f"{name} {t.dtype} {tuple(t.shape)}")
        assert float(line.split()[-1]) == pytest.approx(float(t.double().sum()), rel=1e-6)
    assert all(float(bucket.view(s).abs().sum()) == 0 for s in bucket.slots)  # shared pages
    assert not bucket.fits(1 << 16)
    bucket.clear()
    assert bucket.fits(1 << 16)
    bucket.close()


def test_the_last_exception_of_a_log_names_the_cause() -> None:
    lines = [
        "INFO starting",
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "x.py", line 1, in <module>',
        "[rank0]: RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2",
        "WARNING something after",
    ]
    assert last_exception(lines) == (
        "RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2"
    )
    assert last_exception(["all fine"]) is None


def _spec() -> EngineSpec:
    return EngineSpec("m", "float32", 16, MIB, sleep_mode=False, enforce_eager=True)


def test_an_interpreter_that_is_not_there_is_refused_by_key(tmp_path: Path) -> None:
    with pytest.raises(VllmEngineError) as info:
        EngineProcess(
            _spec(), python=str(tmp_path / "nope" / "python"), log=tmp_path / "e.log",
            bucket_bytes=MIB, threads=1, cuda_index=None, rank=0,
        )  # fmt: skip
    assert "rl.vllm_python" in str(info.value) and "make vllm-venv" in str(info.value)


def test_an_interpreter_without_vllm_fails_the_start_in_one_paragraph(tmp_path: Path) -> None:
    """The trainer's own Python has no vLLM here: the engine process reports the import
    error and the paragraph says where to install vLLM."""
    pytest.importorskip("torch")
    try:
        import vllm  # noqa: F401

        pytest.skip("this interpreter has vLLM")
    except ImportError:
        pass
    process = EngineProcess(
        _spec(), python=sys.executable, log=tmp_path / "e.log", bucket_bytes=MIB, threads=1,
        cuda_index=None, rank=3,
    )  # fmt: skip
    with pytest.raises(VllmEngineError) as info:
        process.wait_ready()
    process.close()
    text = str(info.value)
    assert text.startswith("rl.engine = 'vllm': rank 3's vLLM engine did not start:")
    assert "No module named 'vllm'" in text and "fsdpkit[vllm]" in text
    assert "\n" not in text and str(tmp_path / "e.log") in text
    assert process.proc.poll() is not None


def test_a_stop_string_cuts_where_its_text_first_appears() -> None:
    text = {1: "a", 2: "b", 3: "\n", 4: "c"}

    def decode(ids: list[int]) -> str:
        return "".join(text[i] for i in ids)

    assert stop_string_end([1, 2, 3, 4, 3], ["\n"], decode) == 3
    assert stop_string_end([1, 2, 4], ["\n"], decode) is None
    assert stop_string_end([1, 2, 4], [], decode) is None
    assert stop_string_end([1, 2, 4, 1], ["ca"], decode) == 4


def test_the_kv_cache_holds_one_rollout_in_whole_blocks() -> None:
    per_token = 2 * 2 * 1 * 64 * 4  # k and v, 2 layers, 1 kv head, head_dim 64, fp32
    got = kv_cache_bytes(layers=2, kv_heads=1, head_dim=64, itemsize=4, sequences=1000, tokens=200)
    assert got == 1000 * (2 + 1) * BLOCK * per_token
    assert kv_cache_bytes(layers=1, kv_heads=1, head_dim=64, itemsize=2, sequences=1, tokens=1) == (
        16 * MIB
    )


def test_a_sidecar_sees_none_of_the_ranks_job_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {"RANK": "1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    env = sidecar.sidecar_env({"OMP_NUM_THREADS": "1"}, drop=("VLLM_CPU_KVCACHE_SPACE",))
    assert not {"RANK", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "VLLM_CPU_KVCACHE_SPACE"} & set(env)
    assert env["OMP_NUM_THREADS"] == "1" and env["PATH"] == os.environ["PATH"]
    assert sidecar.visible_device(1) == "5"
