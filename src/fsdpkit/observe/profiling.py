"""``logging.profile_steps = [a, b]``: a torch profiler trace of steps a..b on every
rank, and where their time went (``breakdown``), written to ``RUN_DIR/profile``:

    trace-rank{R}.json    Chrome / Perfetto trace (open in ui.perfetto.dev or chrome://tracing)
    breakdown.json        per rank: each step's categories, their means, the measured times
    breakdown.txt         the same as a table (also printed by rank 0)

On CPU the profiler also records allocations; with c10's process-wide accounting turned
on before the model is built (``enable_process_wide_accounting``, see
[Note: measuring CPU peaks]) that gives each rank's true peak of live tensor memory
during the profiled steps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from fsdpkit.cpumem import allocation_events, quiet_stderr
from fsdpkit.observe.breakdown import CATEGORIES, STEP_PREFIX, per_step_mean, step_breakdown

PROFILE_DIR = "profile"


class StepProfiler:
    """Profiles steps ``first..last`` (1-based, inclusive); ``before``/``after`` bracket
    each step of the loop. Collective at ``after(last)``: every rank must get there."""

    def __init__(
        self, *, first: int, last: int, run_dir: Path, rank: int, device_type: str, memory: bool
    ) -> None:
        self.first, self.last = first, last
        self.dir = run_dir / PROFILE_DIR
        self.rank = rank
        self.device_type = device_type
        self.memory = memory
        self.prof: profile | None = None
        self.annotation: record_function | None = None
        self.measured: dict[int, float] = {}

    def before(self, step: int) -> None:
        if not self.first <= step <= self.last:
            return
        if self.prof is None:  # the first profiled step (a resumed run may start later)
            activities = [ProfilerActivity.CPU]
            if self.device_type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self.prof = profile(activities=activities, profile_memory=self.memory)
            with quiet_stderr():  # Kineto prints a line per start/stop to fd 2
                self.prof.__enter__()
        self.annotation = record_function(f"{STEP_PREFIX}{step}")
        self.annotation.__enter__()

    def after(self, step: int, *, step_time_s: float) -> str | None:
        """Close the step's annotation; after the last one write everything. Returns the
        table for rank 0 to print."""
        if self.annotation is None or self.prof is None:
            return None
        if self.device_type == "cuda":
            torch.cuda.synchronize()
        self.annotation.__exit__(None, None, None)
        self.annotation = None
        self.measured[step] = step_time_s
        if step < self.last:
            return None
        with quiet_stderr():
            self.prof.__exit__(None, None, None)
        mine = self._write_trace()
        self.prof = None
        return self._gather(mine)

    def _write_trace(self) -> dict[str, Any]:
        assert self.prof is not None
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"trace-rank{self.rank}.json"
        self.prof.export_chrome_trace(str(path))
        steps = step_breakdown(json.loads(path.read_text())["traceEvents"])
        for s in steps:  # this rank's own wall-clock time of the step (the loop's dt)
            s["measured_ms"] = self.measured.get(s["step"], 0.0) * 1000
        measured = [s["measured_ms"] for s in steps]
        out: dict[str, Any] = {
            "rank": self.rank,
            "trace": path.name,
            "steps": steps,
            "per_step_ms": per_step_mean(steps),
            "measured_step_ms": sum(measured) / max(len(measured), 1),
            "peak_tensor_mib": self._peak_mib(),
        }
        return out

    def _peak_mib(self) -> float | None:
        """Peak live CPU tensor bytes over the profiled steps (process-wide counter)."""
        if not self.memory or self.device_type != "cpu" or self.prof is None:
            return None
        totals = [total for _, total, _ in allocation_events(self.prof)]
        return max(totals) / 2**20 if totals else None

    def _gather(self, mine: dict[str, Any]) -> str | None:
        everyone: list[Any] = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        if self.rank != 0:
            return None
        (self.dir / "breakdown.json").write_text(json.dumps(everyone, indent=1) + "\n")
        table = format_breakdown(everyone, first=self.first, last=self.last)
        (self.dir / "breakdown.txt").write_text(table + "\n")
        return table


def format_breakdown(ranks: list[dict[str, Any]], *, first: int, last: int) -> str:
    """Per-rank table of mean ms per profiled step."""
    cols = [*CATEGORIES, "comm_total", "comm_exposed"]
    head = f"{'rank':<5}{'measured':>9}{'sum':>9}" + "".join(
        f"{c.replace('_', '-'):>15}" for c in cols
    )
    head += f"{'peak tensor MiB':>17}"
    lines = [f"profiled steps {first}-{last}: mean ms per step (trace-rank*.json)", head]
    for r in ranks:
        ms = r["per_step_ms"]
        total = sum(ms[c] for c in CATEGORIES)
        peak = r.get("peak_tensor_mib")
        lines.append(
            f"{r['rank']:<5}{r['measured_step_ms']:>9.1f}{total:>9.1f}"
            + "".join(f"{ms[c]:>15.1f}" for c in cols)
            + (f"{peak:>17.1f}" if peak is not None else f"{'-':>17}")
        )
    lines.append(
        "comm-exposed = all-gather + reduce-scatter + all-reduce above (communication the "
        "step waited for); comm-total - comm-exposed was hidden behind compute."
    )
    return "\n".join(lines)
