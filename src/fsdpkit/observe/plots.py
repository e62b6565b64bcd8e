"""PNG plots of one or more runs (matplotlib, the ``report`` extra). Formats what
``runlog`` read; computes nothing. Uses ``matplotlib.figure.Figure`` directly, so no
pyplot global state and no display backend are involved."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpkit.observe.breakdown import CATEGORIES
from fsdpkit.observe.runlog import REWARDS, RunLog, Series

PLOTS_DIR = "plots"


@dataclass(frozen=True)
class Plot:
    """A written PNG: its path relative to the report, a title and what it shows."""

    file: str
    title: str
    caption: str


def _figure(title: str, ylabel: str) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 3.6), dpi=100, layout="constrained")
    ax = fig.subplots()
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _line(ax: Any, series: Series, label: str, **style: Any) -> bool:
    if not series.values:
        return False
    ax.plot(series.steps, series.values, label=label, **style)
    return True


def _series_plot(runs: list[RunLog], key: str, ylabel: str) -> Callable[[Any], bool]:
    def draw(ax: Any) -> bool:
        drawn = [_line(ax, r.series[key], r.name, linewidth=1.2) for r in runs]
        return any(drawn)

    return draw


def _with_held_out(runs: list[RunLog], key: str, held_out: str) -> Callable[[Any], bool]:
    """A series per training step, and its held-out value at each evaluation as dots."""

    def draw(ax: Any) -> bool:
        drawn = False
        for r in runs:
            label = f"{r.name} " if len(runs) > 1 else ""
            drawn |= _line(ax, r.series[key], f"{label}train", linewidth=1.2)
            drawn |= _line(ax, r.series[held_out], f"{label}held out", marker="o")
        return drawn

    return draw


def _gap(runs: list[RunLog]) -> Callable[[Any], bool]:
    """A GRPO run's rollout log-prob gap per step and the limit that stops the run
    ([Note: the log-prob gap] in fsdpkit.rollout.gap), on a log scale: float noise sits
    near 1e-6, a broken weight update at whole nats."""

    def draw(ax: Any) -> bool:
        drawn = False
        for r in runs:
            label = f"{r.name} " if len(runs) > 1 else ""
            if not _line(ax, r.series["rl/logprob_gap_max"], f"{label}max", linewidth=1.2):
                continue
            drawn = True
            _line(ax, r.series["rl/logprob_gap_mean"], f"{label}mean", linestyle="--")
            limit = (r.config.get("rl") or {}).get("logprob_gap_max")
            if isinstance(limit, int | float):
                ax.axhline(limit, color="red", linestyle=":", label=f"{label}rl.logprob_gap_max")
        if drawn:
            ax.set_yscale("log")
        return drawn

    return draw


def _rewards(runs: list[RunLog]) -> Callable[[Any], bool]:
    """A DPO run's rewards: chosen, rejected and their margin (nothing for other runs)."""

    def draw(ax: Any) -> bool:
        drawn = False
        for r in runs:
            label = f"{r.name} " if len(runs) > 1 else ""
            for key in REWARDS[:3]:
                drawn |= _line(ax, r.series[key], label + key.split("/")[1], linewidth=1.2)
        return drawn

    return draw


def _memory(runs: list[RunLog]) -> Callable[[Any], bool]:
    def draw(ax: Any) -> bool:
        drawn = False
        for r in runs:
            prefix = f"{r.name} " if len(runs) > 1 else ""
            for rank, series in sorted(r.memory.items()):
                drawn |= _line(ax, series, f"{prefix}rank {rank}", linewidth=1.2)
        return drawn

    return draw


def _checkpoints(runs: list[RunLog]) -> Callable[[Any], bool]:
    def draw(ax: Any) -> bool:
        drawn = False
        for r in runs:
            s = r.series["checkpoint_blocking_s"]
            if s.values:
                ax.plot(s.steps, s.values, marker="s", linestyle="--", label=r.name)
                drawn = True
        return drawn

    return draw


def _breakdown(fig: Any, runs: list[RunLog]) -> bool:
    rows = [(r.name, b) for r in runs for b in r.breakdown]
    if not rows:
        return False
    ax = fig.axes[0]
    ax.set_ylabel("ms per step")
    labels = [
        f"{name}\nrank {b['rank']}" if len(runs) > 1 else f"rank {b['rank']}" for name, b in rows
    ]
    bottom = [0.0] * len(rows)
    for cat in CATEGORIES:  # in the order they stack
        heights = [b["per_step_ms"].get(cat, 0.0) for _, b in rows]
        ax.bar(labels, heights, bottom=bottom, label=cat.replace("_", "-"))
        bottom = [x + h for x, h in zip(bottom, heights)]
    measured = [b["measured_step_ms"] for _, b in rows]
    ax.scatter(labels, measured, color="black", marker="_", s=400, label="measured step", zorder=3)
    return True


def _save(fig: Any, ax: Any, path: Path) -> None:
    if len(ax.get_legend_handles_labels()[0]) > 1:  # one line needs no legend
        ax.legend(fontsize=8)
    fig.savefig(path, format="png")


def render(runs: list[RunLog], out_dir: Path) -> list[Plot]:
    """Write every plot that has data into ``out_dir/plots``; returns them in order."""
    plot_dir = out_dir / PLOTS_DIR
    plot_dir.mkdir(parents=True, exist_ok=True)
    mem_kind = runs[0].memory_kind or "memory"
    specs: list[tuple[str, str, str, str, Callable[[Any], bool]]] = [
        ("loss", "Loss", "loss", "train loss every logged step; validation loss as dots",
         _with_held_out(runs, "loss", "val_loss")),
        ("rl_reward", "GRPO reward", "reward", "mean total reward of the step's completions; "
         "held out: one completion per held-out prompt at each evaluation, as dots",
         _with_held_out(runs, "rl/reward", "val_reward")),
        ("rl_pass_rate", "GRPO pass rate", "share", "share of completions the exact / math "
         "reward grades correct; held-out prompts as dots",
         _with_held_out(runs, "rl/pass_rate", "val_pass_rate")),
        ("logprob_gap", "Rollout log-prob gap", "nats", "|engine - trainer| log-prob of the "
         "sampled tokens each step; the run stops above rl.logprob_gap_max", _gap(runs)),
        ("rewards", "DPO rewards", "reward", "beta x policy/reference log-ratio of each "
         "side, mean over the step's pairs", _rewards(runs)),
        ("reward_accuracy", "DPO reward accuracy", "share of pairs",
         "chosen reward above rejected", _series_plot(runs, "rewards/accuracy", "share")),
        ("lr", "Learning rate", "LR", "the LR each step used", _series_plot(runs, "lr", "LR")),
        ("grad_norm", "Gradient norm", "global norm", "before clipping",
         _series_plot(runs, "grad_norm", "norm")),
        ("tokens_per_s", "Throughput", "tokens/s", "all ranks together",
         _series_plot(runs, "tokens_per_s", "tokens/s")),
        ("memory", "Peak memory per rank", "MiB", f"high-water mark so far ({mem_kind})",
         _memory(runs)),
        ("checkpoint_blocking", "Checkpoint blocking time", "seconds",
         "time the training loop waited for each save", _checkpoints(runs)),
    ]  # fmt: skip
    plots = []
    for stem, title, ylabel, caption, draw in specs:
        fig, ax = _figure(title, ylabel)
        if draw(ax):
            _save(fig, ax, plot_dir / f"{stem}.png")
            plots.append(Plot(f"{PLOTS_DIR}/{stem}.png", title, caption))
    fig, ax = _figure("Where the profiled step time went", "ms per step")
    if _breakdown(fig, runs):
        _save(fig, ax, plot_dir / "step_breakdown.png")
        plots.append(
            Plot(
                f"{PLOTS_DIR}/step_breakdown.png",
                "Step time breakdown",
                "profiled steps (logging.profile_steps); communication shown is the exposed part",
            )
        )
    return plots
