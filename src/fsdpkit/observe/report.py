"""``write_report``: plots and one HTML page for one run, or several compared.

    from fsdpkit.observe import write_report
    write_report([Path("runs/default")])                        # into the run dir
    write_report([Path("runs/a"), Path("runs/b")], out_dir=Path("cmp"))

Reading and summarizing is ``runlog``; drawing is ``plots``; the page is ``page``.
matplotlib comes with the ``report`` extra; without it this raises ReportUnavailable
(one message naming the install command), which ``fsdpkit train`` prints and goes on.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fsdpkit.errors import UserError
from fsdpkit.observe.page import write_page
from fsdpkit.observe.plots import render
from fsdpkit.observe.runlog import RunLogError, load_runs

INSTALL_HINT = "pip install 'fsdpkit[report]'"


class ReportUnavailable(UserError):
    """matplotlib (the ``report`` extra) is not installed."""


def require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise ReportUnavailable(
            "the run report needs matplotlib, which is not installed. Install it with "
            f"{INSTALL_HINT} (or turn the end-of-run report off with logging.report = false)."
        )


def write_report(run_dirs: list[Path], *, out_dir: Path | None = None) -> Path:
    """Write PNG plots and ``report.html``; returns the page's path. One run defaults to
    its own directory; several runs need ``out_dir``."""
    if not run_dirs:
        raise RunLogError("give at least one run directory.")
    if out_dir is None:
        if len(run_dirs) > 1:
            raise RunLogError(
                f"{len(run_dirs)} runs are compared in one report: say where it goes with "
                "-o DIR (e.g. fsdpkit report runs/a runs/b -o runs/compare)."
            )
        out_dir = run_dirs[0]
    runs = load_runs(run_dirs)
    require_matplotlib()

    out_dir.mkdir(parents=True, exist_ok=True)
    return write_page(runs, render(runs, out_dir), out_dir)
