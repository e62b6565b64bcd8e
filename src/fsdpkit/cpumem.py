"""CPU tensor memory of this process, counted exactly: live bytes now, the peak of a call.

[Note: measuring CPU peaks]
c10's CPU allocator keeps a running total of allocated bytes only when asked: the
profiler asks per thread (so a buffer freed on a gloo worker thread is never
subtracted and the count drifts), while the global flag
``FLAGS_caffe2_report_cpu_memory_usage`` (an exported bool in libc10, set here via
ctypes) makes it count every allocation and free of the process. With the flag set
before the model is built, each allocation event the profiler records carries the
process-wide live total, and its maximum over the step is the peak — exactly
repeatable, equal on every rank for symmetric configs, and it includes what a
tracker cannot see (buffers allocated inside gloo collectives). RSS overstates by
1.4-2.1x (allocator caching, libraries) and tracemalloc does not see tensors.
Used by the planner's measurement (fsdpkit.planner.traced.measure), the run's memory
telemetry and profiles on CPU (fsdpkit.observe) and the benches.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
from collections.abc import Callable, Iterator

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

_FLAG = "FLAGS_caffe2_report_cpu_memory_usage"


def enable_process_wide_accounting() -> None:
    """Make c10's CPU allocator count every allocation of the process (see note)."""
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(lib, _FLAG).value = True


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Kineto prints a line on every profiler start/stop straight to fd 2."""
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def allocation_events(prof: profile) -> list[tuple[int, int, int]]:
    """(time, live total after the event, size) of every allocation event, in order."""
    out = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            out.append((event.start_time_ns, fields.total_allocated, fields.alloc_size))
    return sorted(out)


def _profiled(fn: Callable[[], object]) -> list[tuple[int, int, int]]:
    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return allocation_events(prof)


def live_bytes() -> int:
    """Bytes the process holds in CPU tensors now (needs the flag)."""
    gc.collect()
    events = _profiled(lambda: torch.empty(1024, dtype=torch.uint8))
    _, total, size = events[0]
    return total - size


def peak_bytes(fn: Callable[[], object]) -> int:
    """Highest live CPU tensor bytes while ``fn`` runs (needs the flag)."""
    events = _profiled(fn)
    return max(total for _, total, _ in events) if events else live_bytes()
