"""Reading a run directory back: metrics.jsonl into series, plus its config, hardware
and profile summaries. All the computing a report needs happens here; the plot and
HTML modules only format what this returns (design rule: reports never compute).

metrics.jsonl holds four kinds of records (see ``fsdpkit.train.telemetry``): a step
record (``loss``, ``lr``, ``grad_norm``, ``tokens_per_s``, ``peak_mem_mib`` per rank,
a GRPO run's ``rl/*``, ...), ``{"step", "val_loss"}`` (a GRPO run: ``val_reward``,
``val_pass_rate``), ``{"step", "checkpoint_blocking_s"}`` and, at each start,
``{"step", "data"}`` (what the run trains on: fsdpkit.data.TrainingData.record). A torn last
line (a killed writer) is skipped, as the metrics writer itself does.
"""

from __future__ import annotations

import json
import statistics
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdpkit.errors import UserError
from fsdpkit.planner.experts.routing import Routing, from_records

HARDWARE_FILE = "hardware.json"
BREAKDOWN_FILE = "profile/breakdown.json"


class RunLogError(UserError):
    """A directory given to ``fsdpkit report`` is not a run directory."""


@dataclass
class Series:
    """One metric over steps (x and y of the same length)."""

    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def add(self, step: int, value: Any) -> None:
        if isinstance(value, int | float) and not isinstance(value, bool):
            self.steps.append(step)
            self.values.append(float(value))


@dataclass
class RunLog:
    """Everything a report shows about one run."""

    name: str
    run_dir: Path
    series: dict[str, Series]
    memory: dict[int, Series]
    memory_kind: str | None
    config_text: str
    config: dict[str, Any]
    hardware: dict[str, Any]
    breakdown: list[dict[str, Any]]
    summary: dict[str, Any]


SERIES = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mfu")
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy")
"""A DPO run's per-step rewards (fsdpkit.trainable.reference)."""
RL = (
    "rl/reward", "rl/pass_rate", "rl/logprob_gap_max", "rl/logprob_gap_mean",
    "val_reward", "val_pass_rate",
)  # fmt: skip
"""A GRPO run's per-step reward, pass rate and log-prob gap (fsdpkit.train.rl_step), and
its held-out reward and pass rate at each evaluation."""


def read_records(path: Path) -> list[dict[str, Any]]:
    """The parseable JSON objects of a metrics.jsonl, in order."""
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            out.append(record)
    return out


def _collect(records: list[dict[str, Any]]) -> tuple[dict[str, Series], dict[int, Series]]:
    series = {name: Series() for name in (*SERIES, *REWARDS, *RL, "checkpoint_blocking_s")}
    memory: dict[int, Series] = {}
    for r in records:
        for name, s in series.items():
            s.add(r["step"], r.get(name))
        for rank, mib in enumerate(r.get("peak_mem_mib") or []):
            memory.setdefault(rank, Series()).add(r["step"], mib)
    return series, memory


def _last(series: Series) -> float | None:
    return series.values[-1] if series.values else None


def summarize(series: dict[str, Series], memory: dict[int, Series]) -> dict[str, Any]:
    """Headline numbers: steps, final/best losses, steady-state throughput, peaks."""
    loss, val = series["loss"], series["val_loss"]
    rate = series["tokens_per_s"].values
    steady = rate[1:] or rate  # the first step pays warm-up (allocations, first gathers)
    blocking = series["checkpoint_blocking_s"].values
    return {
        "steps": loss.steps[-1] if loss.steps else 0,
        "final_loss": loss.values[-1] if loss.values else None,
        "final_val_loss": val.values[-1] if val.values else None,
        "best_val_loss": min(val.values) if val.values else None,
        "final_val_pass_rate": _last(series["val_pass_rate"]),
        "tokens_per_s_median": statistics.median(steady) if steady else None,
        "step_time_s_median": (
            statistics.median(series["step_time_s"].values[1:] or series["step_time_s"].values)
            if series["step_time_s"].values
            else None
        ),
        "peak_mem_mib_per_rank": [max(s.values) for _, s in sorted(memory.items())],
        "checkpoints": len(blocking),
        "checkpoint_blocking_s_total": sum(blocking),
    }


def _json_file(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def load_run(run_dir: Path, *, name: str | None = None) -> RunLog:
    """Read one run directory; raises RunLogError when it holds no metrics."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise RunLogError(
            f"{str(run_dir)!r} is not a run directory: it has no metrics.jsonl. Pass the "
            "directory `fsdpkit train` wrote (logging.run_dir, default runs/default)."
        )
    records = read_records(metrics)
    series, memory = _collect(records)
    config_path = run_dir / "config.toml"
    config_text = config_path.read_text() if config_path.is_file() else ""
    try:
        config = tomllib.loads(config_text)
    except tomllib.TOMLDecodeError:
        config = {}
    kinds = {r["peak_mem_kind"] for r in records if r.get("peak_mem_kind")}
    return RunLog(
        name=name or run_dir.resolve().name,
        run_dir=run_dir,
        series=series,
        memory=memory,
        memory_kind=", ".join(sorted(kinds)) or None,
        config_text=config_text,
        config=config,
        hardware=_json_file(run_dir / HARDWARE_FILE) or {},
        breakdown=_json_file(run_dir / BREAKDOWN_FILE) or [],
        summary=summarize(series, memory),
    )


def load_runs(run_dirs: list[Path]) -> list[RunLog]:
    """Several runs; names are the directory names, made unique with their parents."""
    names = [d.resolve().name for d in run_dirs]
    if len(set(names)) < len(names):
        names = [f"{d.resolve().parent.name}/{d.resolve().name}" for d in run_dirs]
    return [load_run(d, name=n) for d, n in zip(run_dirs, names)]


def run_routing(run_dir: Path) -> Routing:
    """The routing a run under expert parallelism recorded, for ``fsdpkit plan
    --moe-imbalance RUN_DIR`` ([Note: routing in the plan] in fsdpkit.planner.experts.routing)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise RunLogError(
            f"--moe-imbalance {str(run_dir)!r}: not a number and not a run directory (it "
            "has no metrics.jsonl). Pass the busiest ep rank's received / balanced rows "
            "(1.0 = balanced), or the directory a `fsdpkit train` run under parallel.ep "
            "wrote (logging.run_dir)."
        )
    return from_records(read_records(metrics), source=str(run_dir))
