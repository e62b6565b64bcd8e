"""The one object the training loop talks to about observability.

    obs = Observer(cfg, env)            # before the session is built (CPU memory accounting)
    obs.start()                         # after the run dir exists: hardware.json, sinks
    obs.before_step(step)               # step = the 1-based step about to run
    note = obs.after_step(step, step_time_s=dt)   # profiler table after the last profiled step
    obs.on_step(record); obs.on_eval(step, val_loss); obs.on_checkpoint(step, seconds)
    note = obs.close()                  # flush sinks; rank 0 writes the report

Every rank calls every method (the profiler gathers its tables at the last profiled
step); only rank 0 writes scalars, hardware.json and the report. Returned notes are for
rank 0 to show (``Progress.message``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from fsdpkit.config import RunConfig
from fsdpkit.cpumem import enable_process_wide_accounting
from fsdpkit.errors import UserError
from fsdpkit.observe import hardware
from fsdpkit.observe.profiling import StepProfiler
from fsdpkit.observe.report import write_report
from fsdpkit.observe.sinks import Sink, TensorBoardSink, WandbSink, check_installed, scalars
from fsdpkit.runtime.distenv import DistEnv

log = logging.getLogger(__name__)


class Observer:
    def __init__(self, cfg: RunConfig, env: DistEnv, *, cpu_memory: bool = True) -> None:
        """``cpu_memory``: on CPU, have the profiler count live tensor memory; needs the
        Observer made before any tensor of the run (the count must see every allocation)."""
        self.cfg, self.env = cfg, env
        self.lead = env.rank == 0
        check_installed(tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb)
        self.sinks: list[Sink] = []
        self.run_dir = Path(cfg.logging.run_dir)
        self.profiler: StepProfiler | None = None
        if cfg.logging.profile_steps:
            first, last = cfg.logging.profile_steps
            memory = cpu_memory and env.device_type == "cpu"
            if memory:
                enable_process_wide_accounting()
            self.profiler = StepProfiler(
                first=first,
                last=last,
                run_dir=self.run_dir,
                rank=env.rank,
                device_type=env.device_type,
                memory=memory,
            )

    def start(self) -> None:
        """Rank 0: hardware.json and the scalar sinks (the run dir exists by now)."""
        if not self.lead:
            return
        hardware.write(self.run_dir, self.env)
        if self.cfg.logging.tensorboard:
            self.sinks.append(TensorBoardSink(self.run_dir))
        if self.cfg.logging.wandb != "off":
            self.sinks.append(
                WandbSink(self.run_dir, mode=self.cfg.logging.wandb, config=self.cfg.to_dict())
            )

    def before_step(self, step: int) -> None:
        if self.profiler is not None:
            self.profiler.before(step)

    def after_step(self, step: int, *, step_time_s: float) -> str | None:
        if self.profiler is None:
            return None
        return self.profiler.after(step, step_time_s=step_time_s)

    def _write(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        for sink in self.sinks:
            sink.write(record["step"], values)

    def on_step(self, record: dict[str, Any]) -> None:
        self._write(record)

    def on_eval(self, step: int, val_loss: float) -> None:
        self._write({"step": step, "val_loss": val_loss})

    def on_checkpoint(self, step: int, blocking_s: float) -> None:
        self._write({"step": step, "checkpoint_blocking_s": blocking_s})

    def close(self) -> str | None:
        """Flush the sinks; rank 0 writes the report (a missing matplotlib is one line,
        not a failed run). Returns what to show."""
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        if not (self.lead and self.cfg.logging.report):
            return None

        try:
            page = write_report([self.run_dir])
        except UserError as exc:
            return f"report skipped: {exc}"
        return f"report: {page}"
