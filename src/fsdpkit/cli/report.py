"""``fsdpkit report RUN_DIR [RUN_DIR ...] [-o OUT]``: plots and one HTML page.

    fsdpkit report runs/default                   # writes runs/default/report.html + plots/
    fsdpkit report runs/a runs/b -o runs/compare  # several runs compared in one report

The page is self-contained (plots embedded); open it in any browser. `fsdpkit train`
writes the same report at the end of a run unless logging.report = false.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "report",
        help="plots and an HTML page for one run, or several compared",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    p.add_argument(
        "-o",
        "--out",
        type=Path,
        default=None,
        help="directory for report.html and plots/ (default: the run dir; required for "
        "several runs)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fsdpkit.observe import write_report

    page = write_report(args.run_dirs, out_dir=args.out)
    print(f"fsdpkit report: wrote {page}")
    return 0
