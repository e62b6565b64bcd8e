"""Where a profiled step's time went, computed from its Chrome trace (pure; no torch).

[Note: step breakdown]
A step is the span of its ``fsdpkit.step#N`` annotation on the training thread. Every
instant of it gets exactly one category, by priority:

1. ``data``: inside the ``fsdpkit.data`` annotation (the loader's next batch);
2. ``optimizer``: inside ``Optimizer.step#...`` / ``Optimizer.zero_grad#...``;
3. a collective kind (``all_gather``, ``reduce_scatter``, ``all_reduce`` - the last
   also holds broadcasts and barriers) while the thread is inside a c10d op;
4. ``compute``: inside any other operator (``aten::``, ``fsdp::``...; on CUDA: while a
   non-NCCL kernel runs on the device);
5. the kind of a collective that is executing (gloo worker thread, or NCCL kernel)
   while nothing of the above runs: communication the step waits for, i.e. exposed;
6. ``other``: Python, framework hooks and idle time with no collective in flight.

So the categories add up to the span exactly; the span is compared with the loop's own
wall-clock step time. Collective categories are the *exposed* communication; ``comm
total`` is the union of all collective time (execution, and c10d ops on the training
thread), so ``total - exposed`` is the part hidden behind compute. gloo runs
reduce-scatter as an all-reduce on its worker thread, so a worker event takes the kind
of the c10d op issued last before it started.
"""

from __future__ import annotations

import bisect
import itertools
import re
from typing import Any

CATEGORIES = (
    "compute",
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "optimizer",
    "data",
    "other",
)
COMM = ("all_gather", "reduce_scatter", "all_reduce")
STEP_PREFIX = "fsdpkit.step#"
DATA_NAME = "fsdpkit.data"
_OP = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*::")
_NOT_COMPUTE = ("autograd::", "FSDP::", "c10d::", "_c10d_functional::", "record_param_comms")

Interval = tuple[float, float]


def comm_kind(name: str) -> str | None:
    """Which collective an op / worker event / kernel name is, or None."""
    low = name.lower().replace("_", "")
    if not (
        low.startswith(("c10d::", "c10dfunctional::", "gloo:"))
        or "nccl" in low
        or "ncclkernel" in low
    ):
        return None
    if "allgather" in low:
        return "all_gather"
    if "reducescatter" in low:
        return "reduce_scatter"
    if "waittensor" in low or "wrap" in low:
        return None
    return "all_reduce"


def _merge(intervals: list[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


class _Set:
    """Merged intervals with O(log n) membership."""

    def __init__(self, intervals: list[Interval]) -> None:
        self.iv = _merge(intervals)
        self.starts = [a for a, _ in self.iv]

    def __contains__(self, t: float) -> bool:
        i = bisect.bisect_right(self.starts, t) - 1
        return i >= 0 and self.iv[i][0] <= t < self.iv[i][1]

    def length(self, lo: float, hi: float) -> float:
        return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in self.iv)


def _span(e: dict[str, Any]) -> Interval:
    return float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))


def _host_sets(events: list[dict[str, Any]], tid: Any) -> dict[str, _Set]:
    """Interval sets on the training thread: data, optimizer, compute, each c10d kind."""
    buckets: dict[str, list[Interval]] = {k: [] for k in ("data", "optimizer", "compute", *COMM)}
    for e in events:
        if e.get("tid") != tid:
            continue
        name = e["name"]
        if name == DATA_NAME:
            buckets["data"].append(_span(e))
        elif name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
            buckets["optimizer"].append(_span(e))
        elif (kind := comm_kind(name)) is not None:
            buckets[kind].append(_span(e))
        elif _OP.match(name) and not name.startswith(_NOT_COMPUTE):
            buckets["compute"].append(_span(e))
    return {k: _Set(v) for k, v in buckets.items()}


def _comm_exec(
    events: list[dict[str, Any]], tid: Any, issued: list[tuple[float, str]]
) -> dict[str, list[Interval]]:
    """Collective execution off the training thread: gloo worker events and NCCL kernels."""
    out: dict[str, list[Interval]] = {k: [] for k in COMM}
    issue_ts = [t for t, _ in issued]
    for e in events:
        name = e["name"]
        if e.get("tid") == tid or not (name.startswith("gloo:") or "nccl" in name.lower()):
            continue
        kind = comm_kind(name) or "all_reduce"
        if name.startswith("gloo:"):
            i = bisect.bisect_right(issue_ts, float(e["ts"])) - 1
            kind = issued[i][1] if i >= 0 else kind
        out[kind].append(_span(e))
    return out


def _device_compute(events: list[dict[str, Any]]) -> list[Interval]:
    return [
        _span(e) for e in events if e.get("cat") == "kernel" and "nccl" not in e["name"].lower()
    ]


def _classify(t: float, host: dict[str, _Set], execs: dict[str, _Set]) -> str:
    for cat in ("data", "optimizer", *COMM):
        if t in host[cat]:
            return cat
    if t in host["compute"]:
        return "compute"
    for kind in COMM:
        if t in execs[kind]:
            return kind
    return "other"


def step_breakdown(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per profiled step: milliseconds in each category (they add up to ``span_ms``),
    plus ``comm_total`` and ``comm_exposed``. ``events``: a Chrome trace's traceEvents."""
    complete = [e for e in events if e.get("ph") == "X" and "name" in e and "ts" in e]
    steps = sorted(
        (e for e in complete if e["name"].startswith(STEP_PREFIX)), key=lambda e: e["ts"]
    )
    if not steps:
        return []
    tid = steps[0].get("tid")
    host = _host_sets(complete, tid)
    issued = sorted(
        (float(e["ts"]), k)
        for e in complete
        if e.get("tid") == tid and (k := comm_kind(e["name"])) is not None
    )
    exec_lists = _comm_exec(complete, tid, issued)
    device_compute = _device_compute(complete)
    if device_compute:  # CUDA: compute is what the device runs
        host["compute"] = _Set(device_compute)
    execs = {k: _Set(v) for k, v in exec_lists.items()}
    # Everything any collective occupies: execution plus the training thread's c10d ops.
    all_exec = _Set([iv for k in COMM for iv in (*exec_lists[k], *host[k].iv)])
    return [_one_step(s, host, execs, all_exec, bool(device_compute)) for s in steps]


def _one_step(
    step: dict[str, Any],
    host: dict[str, _Set],
    execs: dict[str, _Set],
    all_exec: _Set,
    device: bool,
) -> dict[str, Any]:
    lo, hi = _span(step)
    cuts = {lo, hi}
    for s in (*host.values(), *execs.values()):
        for a, b in s.iv:
            if b > lo and a < hi:
                cuts.update((max(a, lo), min(b, hi)))
    edges = sorted(cuts)
    us = dict.fromkeys(CATEGORIES, 0.0)
    for a, b in itertools.pairwise(edges):
        us[_classify((a + b) / 2, host, execs)] += b - a
    ms = {k: v / 1000 for k, v in us.items()}
    ms["comm_exposed"] = sum(ms[k] for k in COMM)
    ms["comm_total"] = all_exec.length(lo, hi) / 1000
    return {
        "step": int(step["name"][len(STEP_PREFIX) :]),
        "span_ms": (hi - lo) / 1000,
        "timeline": "device" if device else "host",
        "ms": ms,
    }


def per_step_mean(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Mean milliseconds per step of each category over the profiled steps."""
    keys = (*CATEGORIES, "comm_total", "comm_exposed")
    n = max(len(steps), 1)
    return {k: sum(s["ms"][k] for s in steps) / n for k in keys}
