"""The report's HTML page: one self-contained file (PNG plots embedded as data URIs,
each linked to its file beside the page), the summary, the resolved config, the
hardware and the profiled step breakdown. Formats ``runlog`` results; computes nothing."""

from __future__ import annotations

import base64
import datetime
import html
from pathlib import Path
from typing import Any

from fsdpkit.observe.breakdown import CATEGORIES
from fsdpkit.observe.plots import Plot
from fsdpkit.observe.runlog import RunLog

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0 1em; }
td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: right; font-size: 0.9em; }
th:first-child, td:first-child { text-align: left; }
.plots { display: flex; flex-wrap: wrap; gap: 12px; }
figure { margin: 0; width: 540px; } figure img { width: 100%; border: 1px solid #eee; }
figcaption { font-size: 0.85em; color: #555; }
pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
"""

_SUMMARY_ROWS = [
    ("steps", "steps", "{}"),
    ("final train loss", "final_loss", "{:.4f}"),
    ("final validation loss", "final_val_loss", "{:.4f}"),
    ("best validation loss", "best_val_loss", "{:.4f}"),
    ("final held-out pass rate (GRPO)", "final_val_pass_rate", "{:.1%}"),
    ("tokens/s (median, all ranks)", "tokens_per_s_median", "{:,.0f}"),
    ("step time (median)", "step_time_s_median", "{:.3f} s"),
    ("checkpoints saved", "checkpoints", "{}"),
    ("checkpoint blocking (total)", "checkpoint_blocking_s_total", "{:.2f} s"),
]


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    return spec.format(value)


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _summary(runs: list[RunLog]) -> str:
    rows = [
        [label, *(_fmt(r.summary.get(key), spec) for r in runs)]
        for label, key, spec in _SUMMARY_ROWS
    ]
    peaks = [
        ", ".join(f"{m:,.0f}" for m in r.summary["peak_mem_mib_per_rank"]) or "-" for r in runs
    ]
    rows.append(["peak memory per rank (MiB)", *peaks])
    rows.append(["memory measured as", *(r.memory_kind or "-" for r in runs)])
    return _table(["", *(r.name for r in runs)], rows)


def _figure(plot: Plot, out_dir: Path) -> str:
    data = base64.b64encode((out_dir / plot.file).read_bytes()).decode("ascii")
    src = html.escape(plot.file)
    return (
        f'<figure><a href="{src}"><img src="data:image/png;base64,{data}" '
        f'alt="{html.escape(plot.title)} ({src})"></a>'
        f"<figcaption><b>{html.escape(plot.title)}</b>: {html.escape(plot.caption)} "
        f'(<a href="{src}">{src}</a>)</figcaption></figure>'
    )


def _breakdown(runs: list[RunLog]) -> str:
    rows = []
    for r in runs:
        for b in r.breakdown:
            ms = b["per_step_ms"]
            rows.append(
                [
                    f"{r.name} rank {b['rank']}" if len(runs) > 1 else f"rank {b['rank']}",
                    f"{b['measured_step_ms']:.1f}",
                    *(f"{ms.get(c, 0.0):.1f}" for c in CATEGORIES),
                    f"{ms['comm_total']:.1f}",
                    f"{ms['comm_exposed']:.1f}",
                ]
            )
    if not rows:
        return ""
    header = ["", "measured step", *(c.replace("_", "-") for c in CATEGORIES)]
    header += ["comm total", "comm exposed"]
    return (
        "<h2>Where the profiled step time went (ms per step)</h2>"
        + _table(header, rows)
        + "<p>Traces for Perfetto / chrome://tracing are in each run's profile/ folder.</p>"
    )


def _hardware(runs: list[RunLog]) -> str:
    keys = sorted({k for r in runs for k in r.hardware})
    if not keys:
        return "<p>No hardware.json in the run directory.</p>"
    rows = [[k, *(str(r.hardware.get(k, "-")) for r in runs)] for k in keys]
    return _table(["", *(r.name for r in runs)], rows)


def _configs(runs: list[RunLog]) -> str:
    parts = []
    for r in runs:
        title = f"<h3>{html.escape(r.name)}</h3>" if len(runs) > 1 else ""
        text = r.config_text or "(no config.toml in the run directory)"
        parts.append(f"{title}<pre>{html.escape(text)}</pre>")
    return "".join(parts)


def write_page(runs: list[RunLog], plots: list[Plot], out_dir: Path) -> Path:
    """Write ``out_dir/report.html``; returns its path."""
    names = ", ".join(r.name for r in runs)
    when = datetime.datetime.now().isoformat(timespec="seconds")
    dirs = ", ".join(str(r.run_dir) for r in runs)
    body = [
        f"<h1>fsdpkit report: {html.escape(names)}</h1>",
        f"<p>Run directories: {html.escape(dirs)}. Written {when}.</p>",
        "<h2>Summary</h2>",
        _summary(runs),
        "<h2>Plots</h2>",
        '<div class="plots">' + "".join(_figure(p, out_dir) for p in plots) + "</div>",
        _breakdown(runs),
        "<h2>Hardware</h2>",
        _hardware(runs),
        "<h2>Resolved config</h2>",
        _configs(runs),
    ]
    page = (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>fsdpkit report: {html.escape(names)}</title><style>{_CSS}</style></head>"
        f"<body>{''.join(body)}</body></html>\n"
    )
    path = out_dir / "report.html"
    path.write_text(page)
    return path
