"""The checkpoint subsystem's user-facing error, and DCP's errors in one line."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

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
