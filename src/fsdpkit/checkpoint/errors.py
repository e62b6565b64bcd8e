"""The checkpoint subsystem's user-facing error, and DCP's errors in one line."""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from fsdpkit.errors import UserError


class CheckpointError(UserError):
    """A checkpoint is missing, incomplete, corrupt or cannot be written; the message
    names the path and what to do."""


def describe_failure(exc: BaseException) -> str:
    """One line from DCP's CheckpointException (a BaseException carrying per-rank errors)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (err, _) = sorted(failures.items(), key=lambda kv: kv[0])[0]
        return f"rank {rank}: {type(err).__name__}: {err}"
    return f"{type(exc).__name__}: {exc}"


def os_error_in(exc: BaseException) -> OSError | None:
    """The first OSError with an errno in ``exc``, DCP's per-rank failures, or their
    causes: what the file system actually said."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        err = todo.pop(0)
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno is not None:
            return err
        failures = getattr(err, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for _, f in sorted(failures.items())]
        todo += [err.__cause__, err.__context__]
    return None


_ADVICE = {
    errno.ENOSPC: "The disk is full: free space there or point logging.run_dir at a larger "
    "disk, then run again to resume.",
    errno.EDQUOT: "Your disk quota is used up: free space or point logging.run_dir "
    "elsewhere, then run again to resume.",
    errno.EROFS: "The file system is read-only: remount it read-write or point "
    "logging.run_dir at a writable directory, then run again to resume.",
    errno.EACCES: "This process may not write there: fix the directory's permissions or "
    "point logging.run_dir elsewhere, then run again to resume.",
    errno.EIO: "The storage reported an I/O error (a failing disk or a dropped network "
    "mount: check `dmesg` and the mount); move the run to healthy storage, then run again "
    "to resume.",
}
_ADVICE[errno.EPERM] = _ADVICE[errno.EACCES]


def write_advice(exc: BaseException) -> str:
    """What to do about a failed checkpoint write, by the file system's errno."""
    err = os_error_in(exc)
    default = "Free disk space or fix permissions (or point logging.run_dir elsewhere) and resume."
    code = err.errno if err is not None and err.errno is not None else -1
    return _ADVICE.get(code, default)


def save_failed(
    *, step: int, tmp: Path, root: Path, exc: BaseException, last_good: Path | None
) -> CheckpointError:
    """One paragraph for a failed save: the cause, what to do, and that nothing was
    lost (the partial directory is removed; the last good checkpoint is named)."""
    kept = (
        f"the last good checkpoint, {last_good}, is untouched and loadable "
        "(checkpoint.resume=auto picks it)"
        if last_good is not None
        else f"there is no earlier complete checkpoint in {root}"
    )
    return CheckpointError(
        f"saving checkpoint step {step} to {tmp} failed: {describe_failure(exc)}. "
        f"{write_advice(exc)} Nothing was torn: the partial {tmp.name} is removed and {kept}."
    )


@contextmanager
def dcp_errors_as(message: Callable[[str], str]) -> Iterator[None]:
    """Turn a failing DCP call into one CheckpointError, ``message(one-line cause)``.

    DCP raises CheckpointException, a BaseException, so ``except Exception`` misses it;
    interrupts and exits still pass through untouched."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        raise CheckpointError(message(describe_failure(exc))) from None
