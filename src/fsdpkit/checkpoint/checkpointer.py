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
writes ``.metadata`` (async: staged to CPU copies, written by a DCP thread).  3. each
rank crc32s its own ``__<rank>_*`` files; gathered on rank 0.  4. rank 0 writes
``fsdpkit.json`` (fsync) and renames to ``step-N``.  5. rank 0's outcome is broadcast,
so every rank raises the same error or none (no rank hangs).  6. rank 0 applies
retention ([Note: retention]) while the others go on.
"""

from __future__ import annotations

import datetime
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from fsdpkit.checkpoint import resume as _resume
from fsdpkit.checkpoint.errors import CheckpointError, describe_failure
from fsdpkit.checkpoint.layout import (
    DCP_METADATA,
    FORMAT,
    META_FILE,
    VERSION,
    checkpoints_root,
    file_owner,
    file_record,
    fsync_dir,
    list_entries,
    quiet_single_process,
    remove_tree,
    step_dir_name,
    verify,
    write_json_durably,
)
from fsdpkit.checkpoint.retention import steps_to_delete
from fsdpkit.checkpoint.state import MODEL_KEY, ModelOptimizerState, RankLocal, tied_aliases
from fsdpkit.config import CheckpointConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Job:
    step: int
    tmp: Path
    final: Path
    started: float
    state_info: dict[str, Any]


def state_info(state: dict[str, Any]) -> dict[str, Any]:
    """Facts about ``state``'s layout that offline tools need (export finds the model)."""
    model = [k for k, v in state.items() if isinstance(v, ModelOptimizerState)]
    return {
        "keys": sorted(state),
        "model_prefix": f"{model[0]}.{MODEL_KEY}." if model else None,
        "tied": tied_aliases(state[model[0]].model) if model else {},
        "rank_local": sorted(k for k, v in state.items() if isinstance(v, RankLocal)),
    }


class Checkpointer:
    """Saves ``state`` to ``run_dir/checkpoints/step-NNNNNNNN`` and resumes from it."""

    last_blocking_s: float
    """Seconds the last ``save`` call blocked the caller (async: staging + waiting for
    the previous save; sync: the whole save)."""
    last_total_s: float
    """Seconds from the start of the last completed save until it was committed."""

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
        self.last_blocking_s = 0.0
        self.last_total_s = 0.0

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
        job = _Job(step, self.root / f"{name}.tmp", self.root / name, start, state_info(state))
        self._agree(self._prepare, job)
        if sync:
            self._write(job, state)
            self._finalize(job)
        else:
            future = self._write_async(job, state)
            self._pending = self._pool().submit(self._finish_async, job, future)
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
        return CheckpointError(
            f"saving checkpoint step {job.step} to {job.tmp} failed: {describe_failure(exc)}. "
            f"Earlier checkpoints in {self.root} are untouched and loadable. Free disk space "
            "or fix permissions (or point logging.run_dir elsewhere) and resume."
        )

    def _abandon(self, job: _Job) -> None:
        if self.rank == 0:
            remove_tree(job.tmp)

    def _write(self, job: _Job, state: dict[str, Any]) -> None:
        try:
            with quiet_single_process():
                dcp.save(state, checkpoint_id=str(job.tmp), process_group=self._group)
        except BaseException as exc:  # DCP raises CheckpointException, a BaseException
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            self._abandon(job)
            raise self._save_error(job, exc) from None

    def _write_async(self, job: _Job, state: dict[str, Any]) -> Future[Any]:
        try:
            with quiet_single_process():
                future = dcp.async_save(
                    state, checkpoint_id=str(job.tmp), process_group=self._group
                )
        except Exception as exc:
            self._abandon(job)
            raise self._save_error(job, exc) from None
        return cast(Future, future)

    def _finish_async(self, job: _Job, future: Future[Any]) -> None:
        try:
            future.result()
        except BaseException as exc:
            self._abandon(job)
            raise self._save_error(job, exc) from None
        self._finalize(job)

    # ---------------------------------------------------------------------- commit

    def _local_records(self, tmp: Path) -> dict[str, dict[str, Any]]:
        """crc32 of the files this rank wrote (rank 0 also covers DCP's ``.metadata``)."""
        out = {}
        for path in sorted(tmp.iterdir()):
            if file_owner(path.name, world_size=self.world_size) == self.rank and path.is_file():
                out[path.name] = file_record(path)
        return out

    def _finalize(self, job: _Job) -> None:
        """Steps 3-5 of [Note: save protocol]; collective."""
        try:
            local: Any = self._local_records(job.tmp)
        except OSError as exc:
            local = f"rank {self.rank}: {exc}"
        gathered = self._gather(local)
        try:
            self._agree(self._commit, job, gathered)
        except CheckpointError:
            self._abandon(job)
            raise
        if self.rank == 0:  # after the broadcast: other ranks need not wait for deletes
            self._apply_retention()

    def _commit(self, job: _Job, gathered: list[Any]) -> None:
        errors = [g for g in gathered if isinstance(g, str)]
        if errors:
            raise self._save_error(job, OSError("; ".join(errors)))
        files: dict[str, Any] = {}
        for records in gathered:
            files.update(records)
        if DCP_METADATA not in files:
            raise self._save_error(job, FileNotFoundError(f"DCP wrote no {DCP_METADATA}"))
        try:
            write_json_durably(job.tmp / META_FILE, self._meta(job, files))
            self._rename(job)
        except OSError as exc:
            raise self._save_error(job, exc) from None
        self.last_total_s = time.perf_counter() - job.started
        total = sum(r["bytes"] for r in files.values())
        log.info(
            "checkpoint: %s complete (%.1f MB in %.2f s)",
            job.final.name,
            total / 1e6,
            self.last_total_s,
        )

    def _meta(self, job: _Job, files: dict[str, Any]) -> dict[str, Any]:
        now = datetime.datetime.now(datetime.UTC)
        return {
            "format": FORMAT,
            "version": VERSION,
            "step": job.step,
            "time": now.isoformat(timespec="seconds"),
            "unix_time": now.timestamp(),
            "world_size": self.world_size,
            "run": self.run_meta,
            "state": job.state_info,
            "files": files,
        }

    def _rename(self, job: _Job) -> None:
        old = job.final.with_name(job.final.name + ".old")
        if job.final.exists():  # saving a step again (resumed run): replace it
            remove_tree(old)
            job.final.rename(old)
        job.tmp.rename(job.final)
        fsync_dir(self.root)
        remove_tree(old)

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
        for e in entries:
            leftover = not e.complete and e.path.name != step_dir_name(e.step)
            if leftover or (e.complete and e.step in doomed):
                log.info("checkpoint: removing %s", e.path.name)
                remove_tree(e.path)  # errors ignored: a failed delete never fails a save

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
            problems = self._verify_together(path)
            if not problems:
                return self._load(path, state, failed)
            failed.append((path, problems))
        if failed:
            raise _resume.unusable(self.cfg.resume, self.root, failed)
        if self.rank == 0:
            log.info("checkpoint: nothing to resume in %s; starting fresh", self.root)
        return None

    def _verify_together(self, path: Path) -> list[str]:
        try:
            local = verify(path, share=(self.rank, self.world_size)).problems
        except OSError as exc:
            local = [f"rank {self.rank} cannot read {path}: {exc}"]
        gathered = self._gather(local)
        return self._broadcast([p for g in gathered for p in g] if self.rank == 0 else None)

    def _load(self, path: Path, state: dict[str, Any], failed: list[tuple[Path, list[str]]]) -> int:
        if self.rank == 0:
            for bad, problems in failed:
                log.warning("checkpoint: %s", _resume.fallback_warning(bad, problems))
        choice = _resume.choice_for(path)
        _resume.load(choice, state, group=self._group, world_size=self.world_size)
        if self.rank == 0:
            log.info("checkpoint: resumed from %s (step %d)", choice.path, choice.step)
        self._last_step = choice.step
        return choice.step
