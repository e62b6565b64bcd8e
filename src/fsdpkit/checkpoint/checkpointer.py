"""``Checkpointer``: atomic sync/async DCP saves, retention and resume for one run.

Every rank constructs it, after ``init_process_group`` and in the same order relative to
other group creations (it creates its own gloo group), then calls ``save``/``wait``/
``resume`` together.

[Note: checkpoint process group]
All checkpoint collectives (DCP planning, checksum gather, commit broadcast, resume
decision) run on a dedicated gloo group: ``dcp.async_save`` on the training group
aborts gloo with "data size doesn't match" once training continues, and a CPU group
also works next to NCCL. At most one save is in flight, and the main thread touches
the group only after ``wait()``, so two threads never use it at once.

[Note: save protocol]
1. rank 0 clears ``step-N.tmp``; barrier.  2. DCP writes every rank's data and rank 0
writes ``.metadata``, each file crc32'ed as it is written and fsync'ed when closed
([Note: one pass over the bytes]); async: the state is first copied into reused host
buffers ([Note: staging buffers]) and a background thread writes those.  3. each rank's
sizes and crc32s (``.metadata``'s on rank 0) are gathered on rank 0.  4. rank 0 writes
``fsdpkit.json`` (fsync), renames to ``step-N`` and fsyncs the directory.  5. rank 0's
outcome is broadcast, so every rank raises the same error or none (no rank hangs).
6. rank 0 applies retention ([Note: retention]) while the others go on; dropped
checkpoints are removed on a thread ([Note: retention in the background]).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from fsdpkit.checkpoint import commit
from fsdpkit.checkpoint import resume as _resume
from fsdpkit.checkpoint.errors import CheckpointError, save_failed
from fsdpkit.checkpoint.gcpause import gc_paused
from fsdpkit.checkpoint.retention import steps_to_delete
from fsdpkit.checkpoint.staging import Stager
from fsdpkit.checkpoint.statefuls import state_info
from fsdpkit.checkpoint.stepdir import (
    checkpoints_root,
    list_entries,
    quiet_single_process,
    remove_tree,
    step_dir_name,
)
from fsdpkit.checkpoint.trash import Remover, set_aside
from fsdpkit.checkpoint.writer import ChecksumWriter
from fsdpkit.config import CheckpointConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Job:
    step: int
    tmp: Path
    final: Path
    started: float
    state_info: dict[str, Any]
    writer: ChecksumWriter
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds per step of the save (this rank): staging, write, checksum, fsync, commit."""


class Checkpointer:
    """Saves ``state`` to ``run_dir/checkpoints/step-NNNNNNNN`` and resumes from it."""

    last_blocking_s: float
    """Seconds the last ``save`` call blocked the caller (async: staging + waiting for
    the previous save; sync: the whole save)."""
    last_total_s: float
    """Seconds from the start of the last completed save until it was committed."""
    last_save_timings: dict[str, float]
    """This rank's seconds per step of the last committed save: ``staging`` (async
    copy), ``write`` (DCP, including the in-line ``checksum`` and ``fsync``), ``commit``
    (gather, marker, rename)."""
    last_resume_timings: dict[str, float]
    """This rank's seconds per step of the last resume: ``precheck``, ``load`` (DCP,
    including ``read`` and the in-line ``checksum``) and bytes read."""

    def __init__(self, *, run_dir: Path, cfg: CheckpointConfig, run_meta: dict[str, Any]) -> None:
        self.root = checkpoints_root(Path(run_dir))
        self.cfg = cfg
        self.run_meta = dict(run_meta)
        self._distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._distributed else 0
        self.world_size = dist.get_world_size() if self._distributed else 1
        # [Note: checkpoint process group]
        self._group = dist.new_group(backend="gloo") if self._distributed else None
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        self._last_step: int | None = None
        self._remover = Remover(self.root)
        self._stager = Stager()
        self.last_blocking_s = 0.0
        self.last_total_s = 0.0
        self.last_save_timings = {}
        self.last_resume_timings = {}

    @property
    def staging_bytes(self) -> int:
        """Host memory this rank holds for async staging ([Note: staging buffers])."""
        return self._stager.nbytes

    @property
    def in_flight(self) -> bool:
        """Whether an async save is still being written (steps overlap it)."""
        return self._pending is not None and not self._pending.done()

    @property
    def last_step(self) -> int | None:
        """Step of the last checkpoint saved (or started, async) or resumed; lets the loop
        skip a SIGTERM save of a step that ``maybe_save`` just saved."""
        return self._last_step

    # ------------------------------------------------------------------ collectives

    def _broadcast(self, obj: Any) -> Any:
        if not self._distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self._group, group_src=0)
        return box[0]

    def _gather(self, obj: Any) -> list[Any]:
        if not self._distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, group=self._group, group_dst=0)
        return out or []

    def _agree(self, fn: Any, *args: Any) -> Any:
        """Run ``fn`` on rank 0 only and give every rank its result; an exception there
        becomes the same CheckpointError on every rank."""
        result: Any = None
        if self.rank == 0:
            try:
                result = fn(*args)
            except CheckpointError as exc:
                result = exc
            except Exception as exc:
                log.exception("checkpoint: unexpected error on rank 0")
                result = CheckpointError(f"{type(exc).__name__}: {exc}")
        result = self._broadcast(result)
        if isinstance(result, CheckpointError):
            raise CheckpointError(str(result))
        return result

    # ------------------------------------------------------------------------- save

    def save(
        self, step: int, state: dict[str, Stateful | Any], *, blocking: bool | None = None
    ) -> float:
        """Checkpoint ``state`` as step ``step`` ([Note: save protocol]); returns (and
        logs) the seconds it blocked. ``blocking=None`` follows ``cfg.async_save``."""
        start = time.perf_counter()
        self.wait()
        sync = (not self.cfg.async_save) if blocking is None else blocking
        name = step_dir_name(step)
        tmp = self.root / f"{name}.tmp"
        info = state_info(state)
        job = _Job(step, tmp, self.root / name, start, info, ChecksumWriter(tmp))
        self._agree(self._prepare, job)
        if sync:
            self._write(job, state)
            self._finalize(job)
        else:
            staged = self._stage(job, state)
            self._pending = self._pool().submit(self._write_then_finalize, job, staged)
        self._last_step = step
        self.last_blocking_s = time.perf_counter() - start
        if self.rank == 0:
            how = "saved" if sync else "started async save of"
            log.info("checkpoint: %s %s (blocked %.2f s)", how, name, self.last_blocking_s)
        return self.last_blocking_s

    def maybe_save(self, step: int, state: dict[str, Any], *, final: bool = False) -> bool:
        """Save every ``cfg.every`` steps, and at the end (``final``) when periodic saves
        are on; never the same step twice. Returns whether it saved."""
        every = self.cfg.every
        if every <= 0 or step == self._last_step or (step % every and not final):
            return False
        self.save(step, state)
        return True

    def wait(self) -> None:
        """Finish the in-flight async save, if any (call before exit and before loading).
        Raises its CheckpointError on every rank if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
        self._remover.join()

    def close(self) -> None:
        """``wait()``, then stop the background thread."""
        self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="fsdpkit-ckpt")
        return self._executor

    def _prepare(self, job: _Job) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if job.tmp.is_file() or job.tmp.is_symlink():
                job.tmp.unlink()
            remove_tree(job.tmp)
        except OSError as exc:
            raise self._save_error(job, exc) from None

    def _save_error(self, job: _Job, exc: BaseException) -> CheckpointError:
        try:
            done = [e.path for e in list_entries(self.root) if e.complete]
        except OSError:
            done = []
        return save_failed(
            step=job.step,
            tmp=job.tmp,
            root=self.root,
            exc=exc,
            last_good=done[-1] if done else None,
        )

    def _abandon(self, job: _Job) -> None:
        if self.rank == 0:
            remove_tree(job.tmp)

    def _write(self, job: _Job, state: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        try:
            with quiet_single_process(), gc_paused():
                dcp.save(state, storage_writer=job.writer, process_group=self._group)
        except BaseException as exc:  # DCP raises CheckpointException, a BaseException
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            self._abandon(job)
            raise self._save_error(job, exc) from None
        stats = job.writer.stats
        job.timings.update(
            write=time.perf_counter() - t0,
            write_calls=stats.write_s,
            checksum=stats.checksum_s,
            fsync=stats.fsync_s,
        )
        job.timings["bytes"] = float(stats.bytes)

    def _stage(self, job: _Job, state: dict[str, Any]) -> dict[str, Any]:
        """Copy the state into the reused staging buffers; all an async save blocks for.
        Collective: if staging fails on any rank, every rank raises (none starts a
        background write whose collectives would wait for the failed rank forever)."""
        t0 = time.perf_counter()
        staged: dict[str, Any] = {}
        problem = None
        try:
            plain = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}
            staged = self._stager.stage(plain)
        except Exception as exc:
            problem = f"rank {self.rank}: staging failed: {type(exc).__name__}: {exc}"
        gathered = self._gather(problem)
        problems = self._broadcast([p for p in gathered if p] if self.rank == 0 else None)
        if problems:
            self._abandon(job)
            raise self._save_error(job, RuntimeError("; ".join(problems)))
        job.timings["staging"] = time.perf_counter() - t0
        return staged

    def _write_then_finalize(self, job: _Job, staged: dict[str, Any]) -> None:
        self._write(job, staged)
        self._finalize(job)

    # ---------------------------------------------------------------------- commit

    def _finalize(self, job: _Job) -> None:
        """Steps 3-5 of [Note: save protocol]; collective."""
        t0 = time.perf_counter()
        try:
            local: Any = commit.local_records(
                job.tmp, job.writer.records, rank=self.rank, world_size=self.world_size
            )
        except OSError as exc:
            local = f"rank {self.rank}: {exc}"
        gathered = self._gather(local)
        try:
            self._agree(self._commit, job, gathered)
        except CheckpointError:
            self._abandon(job)
            raise
        job.timings["commit"] = time.perf_counter() - t0
        self.last_save_timings = dict(job.timings)
        self.last_total_s = time.perf_counter() - job.started
        if self.rank == 0:  # after the broadcast: other ranks need not wait for deletes
            self._apply_retention()

    def _commit(self, job: _Job, gathered: list[Any]) -> None:
        try:
            files = commit.merge(gathered)
            meta = commit.marker(
                step=job.step,
                world_size=self.world_size,
                run=self.run_meta,
                state=job.state_info,
                files=files,
            )
            commit.publish(job.tmp, job.final, meta)
        except OSError as exc:
            raise self._save_error(job, exc) from None
        total = sum(r["bytes"] for r in files.values())
        seconds = time.perf_counter() - job.started
        log.info(
            "checkpoint: %s complete (%.1f MB in %.2f s)", job.final.name, total / 1e6, seconds
        )

    def _apply_retention(self) -> None:
        """[Note: retention]; also removes leftovers of crashed saves (rank 0, no save
        in flight at this point)."""
        entries = list_entries(self.root)
        doomed = set(
            steps_to_delete(
                [e.step for e in entries if e.complete],
                keep=self.cfg.keep,
                keep_every=self.cfg.keep_every,
            )
        )
        self._remover.join()
        for e in entries:
            leftover = not e.complete and e.path.name != step_dir_name(e.step)
            if leftover or (e.complete and e.step in doomed):
                log.info("checkpoint: removing %s", e.path.name)
                if not set_aside(e.path, root=self.root):
                    remove_tree(e.path)  # errors ignored: a failed delete never fails a save
        self._remover.start()

    # ----------------------------------------------------------------------- resume

    def resume(self, state: dict[str, Any]) -> int | None:
        """Load the checkpoint ``cfg.resume`` selects into ``state`` in place; returns its
        step, or None when there is nothing to resume. Collective: every rank gets the
        same checkpoint or the same CheckpointError ([Note: resume decision])."""
        if self.cfg.resume == "never":
            return None
        self.wait()
        paths = self._agree(_resume.candidates, self.cfg.resume, self.root)
        failed: list[tuple[Path, list[str]]] = []
        for path in paths:
            t0 = time.perf_counter()
            choice = self._agree(_resume.precheck, path)
            precheck_s = time.perf_counter() - t0
            problems = choice.problems or self._load(choice, state, precheck_s)
            if not problems:
                return choice.step
            if self.rank == 0 and path != paths[-1]:
                log.warning("checkpoint: %s", _resume.fallback_warning(path, problems))
            failed.append((path, problems))
        if failed:
            raise _resume.unusable(self.cfg.resume, self.root, failed)
        if self.rank == 0:
            log.info("checkpoint: nothing to resume in %s; starting fresh", self.root)
        return None

    def _load(self, choice: _resume.Choice, state: dict[str, Any], precheck_s: float) -> list[str]:
        problems, stats = _resume.load(
            choice, state, group=self._group, rank=self.rank, world_size=self.world_size
        )
        if problems:
            return problems
        self.last_resume_timings = {
            "precheck": precheck_s,
            "load": stats.load_s,
            "read": stats.read_s,
            "checksum": stats.checksum_s,
            "bytes": float(stats.bytes),
            "direct_bytes": float(stats.direct_bytes),
        }
        if self.rank == 0:
            log.info("checkpoint: resumed from %s (step %d)", choice.path, choice.step)
        self._last_step = choice.step
        return []
