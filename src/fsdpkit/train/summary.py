"""What a run achieved, and the end-of-run table (formats; computes nothing)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fsdpkit.config import RunConfig


@dataclass
class RunSummary:
    """What the run achieved, for the end-of-run table (rank 0 prints it)."""

    steps: int = 0
    final_loss: float | None = None
    val_losses: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0
    peak_mem_mib: float = 0.0
    sample_text: str | None = None
    stop_signal: int | None = None
    """The signal that stopped the run early (SIGTERM, SIGINT, SIGHUP), if any."""
    stop_note: str = ""
    """What the stop saved, for the user ([Note: agreeing to stop])."""
    params: str | None = None
    """Trainable vs total parameters."""
    compile_s: float = 0.0
    """Seconds the training steps spent in torch.compile (train.compile), kept out of
    tokens/s ([Note: compile time] in fsdpkit.sharding.compile)."""


def format_summary(summary: RunSummary, *, cfg: RunConfig) -> str:
    val = summary.val_losses
    rows = [
        ("steps", f"{summary.steps}"),
        (
            "final train loss",
            f"{summary.final_loss:.4f}" if summary.final_loss is not None else "-",
        ),
        ("final validation loss", f"{val[-1]:.4f}" if val else "-"),
        ("best validation loss", f"{min(val):.4f}" if val else "-"),
        ("tokens/s (all ranks)", f"{summary.tokens_per_s:,.0f}"),
        ("compile time", f"{summary.compile_s:.1f} s" if cfg.train.compile else "-"),
        ("peak memory per rank", f"{summary.peak_mem_mib:,.0f} MiB"),
        ("parameters", summary.params or "-"),
        ("run directory", cfg.logging.run_dir),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["", "summary", "-" * (width + 20)]
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    if summary.sample_text:
        lines += ["", "sample:", printable(summary.sample_text.strip()[:600])]
    return "\n".join(lines)


def printable(text: str) -> str:
    """``text`` safe for a terminal: a sample of an untrained byte-level model is random
    bytes, among them ESC and other control characters that would drive the terminal;
    each is shown as its escape (``\\x1b``). Newlines and tabs stay."""
    return "".join(c if c in "\n\t" or c.isprintable() else repr(c)[1:-1] for c in text)


def print_summary(summary: RunSummary, *, cfg: RunConfig) -> None:
    print(format_summary(summary, cfg=cfg), flush=True)
