"""Results files every bench writes, and the docs tables rendered from them.

A bench calls ``write(NAME, command=..., rows=..., **figures)``: ``bench/results/NAME.json``
gets the command line, the commit, the machine, the date and the load average beside
the figures, so a number in the docs can be traced to the run that measured it. A
docs table quoting a bench is not typed: it lives between ``<!-- NAME:begin -->`` and
``<!-- NAME:end -->`` in a Markdown file, and ``render_into(doc, NAME, text)`` writes
it from the bench's own ``render(results)``; ``tests/unit/test_bench_docs.py`` checks
every such block against its results file.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

BENCH = Path(__file__).parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
"""Every Markdown file a rendered block may live in."""
BLOCK = re.compile(r"<!-- ([a-z0-9_]+):begin -->\n(.*?)<!-- \1:end -->", re.S)
"""A rendered block in a Markdown file: its bench's name and its text."""


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, check=False, cwd=ROOT)
    except OSError:
        return ""
    return done.stdout.strip()


def commit() -> str:
    """The short commit of the tree the bench ran on (``+dirty`` with local changes)."""
    head = _git("rev-parse", "--short", "HEAD") or "unknown"
    return f"{head}+dirty" if _git("status", "--porcelain", "--untracked-files=no") else head


def machine() -> str:
    return f"{platform.node()} {platform.machine()} {os.cpu_count()} cores"


def path(name: str) -> Path:
    return RESULTS / f"{name}.json"


def write(name: str, *, command: str | None = None, **figures: Any) -> Path:
    """``bench/results/NAME.json``: where and when it ran, and ``figures``."""
    out = path(name)
    out.parent.mkdir(exist_ok=True)
    record = {
        "command": command or "python " + " ".join(sys.argv),
        "commit": commit(),
        "machine": machine(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()],
        **figures,
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    return out


def read(name: str) -> dict[str, Any]:
    return json.loads(path(name).read_text())


def provenance(results: dict[str, Any], name: str) -> str:
    """The line under a rendered table: command, commit, machine, date, load."""
    load = results.get("load_avg_1_5_15")
    return (
        f"`{results['command']}` (commit {results['commit']}, {results['machine']}, "
        f"{results['date'][:10]}" + (f", load {load}" if load else "") + f"; "
        f"`bench/results/{name}.json`)."
    )


def steps_table(
    results: dict[str, Any],
    name: str,
    *,
    header: list[str],
    cells: Callable[[dict[str, Any], float], list[str]],
) -> str:
    """A rendered table of a ``steps_main`` bench: the provenance line, then a row of
    ``cells(row, typical)`` per results row (``typical``: the median of its steps)."""
    lines = [provenance(results, name), "", "| " + " | ".join(header) + " |"]
    lines.append("| " + " | ".join("---" for _ in header) + " |")
    for r in results["rows"]:
        lines.append("| " + " | ".join(cells(r, statistics.median(r["steps"]))) + " |")
    return "\n".join(lines) + "\n"


def render_into(doc: Path, name: str, text: str) -> None:
    """Replace the ``name`` block of ``doc`` with ``text``."""
    source = doc.read_text()
    begin, end = f"<!-- {name}:begin -->\n", f"<!-- {name}:end -->"
    if begin not in source or end not in source:
        raise SystemExit(
            f"{doc.relative_to(ROOT)} has no {name} block: bench/results/{name}.json is "
            f"written; add the lines '{begin.strip()}' and '{end}' where its table goes "
            f"and run `python bench/{name}.py --render-docs`"
        )
    lo, hi = source.index(begin) + len(begin), source.index(end)
    doc.write_text(source[:lo] + text.rstrip("\n") + "\n" + source[hi:])
    print(f"rendered {doc.relative_to(ROOT)} from {path(name).relative_to(ROOT)}")


def blocks(doc: Path) -> list[tuple[str, str]]:
    """(bench name, rendered text) of every block in ``doc``."""
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer(doc.read_text())]


def bench(name: str) -> ModuleType:
    """``bench/NAME.py`` as a module (its ``render`` makes NAME's blocks)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    if spec is None or spec.loader is None or not (BENCH / f"{name}.py").is_file():
        raise FileNotFoundError(f"a block names bench/{name}.py, which does not exist")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def steps_main(
    name: str,
    *,
    doc: Path,
    description: str,
    measure: Callable[[int], list[dict[str, Any]]],
    render: Callable[[dict[str, Any]], str],
) -> None:
    """The command line of a bench that measures ``--steps`` steps per row: runs
    ``measure``, writes its rows with the time taken, prints the table and renders it
    into ``doc`` (``--render-docs``: only the last)."""
    import argparse
    import time

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--render-docs", action="store_true", help="only re-render the docs")
    a = p.parse_args()
    if not a.render_docs:
        t0 = time.perf_counter()
        rows = measure(a.steps)
        write(name, seconds=round(time.perf_counter() - t0), steps=a.steps, rows=rows)
        print(render(read(name)))
    render_into(doc, name, render(read(name)))


def render_all() -> None:
    """Re-render every block in ``DOCS`` from its committed results file (``make
    bench-docs``): nothing is rerun, so only a changed ``render`` or results file moves."""
    for doc in DOCS:
        for name in dict.fromkeys(n for n, _ in blocks(doc)):
            render_into(doc, name, bench(name).render(read(name)))


if __name__ == "__main__":
    render_all()
