"""Figures in the docs are the results files' own: every rendered block in README.md,
BENCHMARKS.md and docs/*.md (``<!-- NAME:begin -->`` ... ``<!-- NAME:end -->``, see
bench/results_io.py) equals what ``bench/NAME.py``'s ``render`` makes of the committed
``bench/results/NAME.json``, and that file says how, where and when it was measured."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import results_io  # noqa: E402

DOCS = results_io.DOCS
BLOCKS = [(doc, name, text) for doc in DOCS for name, text in results_io.blocks(doc)]


RENDERED = {
    "data_scale", "optimizer_step", "step_overhead", "finetune_memory", "hf_load_memory",
    "loss_compile", "checkpoint_io", "plan_accuracy", "model_parallel", "dpo_memory",
    "slurm_scenarios",
    "model_parallel_pp",
    "expert_parallel",
    "moe_routing_replay",
    "hang_overhead",
    "checkpoint_staging",
    "rl_learns",
    "plan_finetune",
    "plan_pipeline_finetune",
    "plan_pipeline_moe",
}  # fmt: skip
"""Benches whose tables the docs quote: each must have a block and a results file."""


def test_the_docs_have_rendered_blocks() -> None:
    assert {name for _, name, _ in BLOCKS} >= RENDERED


@pytest.mark.parametrize(
    ("doc", "name", "text"), BLOCKS, ids=[f"{d.name}:{n}" for d, n, _ in BLOCKS]
)
def test_block_is_rendered_from_its_results_file(doc: Path, name: str, text: str) -> None:
    assert results_io.path(name).is_file(), (
        f"{doc.name} quotes bench/{name}.py but there is no results file behind it: run "
        f"`python bench/{name}.py` (it writes bench/results/{name}.json) and commit the file"
    )
    results = results_io.read(name)
    for key in ("command", "commit", "machine", "date"):
        assert results.get(key), f"bench/results/{name}.json has no {key!r}"
    assert text == results_io.bench(name).render(results).rstrip("\n") + "\n", (
        f"{doc.name}'s {name} block differs from its results file: run "
        f"`python bench/{name}.py --render-docs`"
    )


LABEL = re.compile(r"not\s+rerun\s+since|not\s+yet\s+run", re.I)
"""What an old or missing figure must say about itself where it is quoted."""
BENCH_REF = re.compile(r"bench/[a-z0-9_]+\.py")
FIGURE = re.compile(r"\d\.\d|\d(?:\s?(?:%|x\b|MiB|GiB|MB|GB|ms\b|tok/s))")
"""A measured-looking number: a decimal, or digits with a unit, a percent or an 'x'."""


def _units(text: str) -> list[tuple[int, list[str], str]]:
    """(first line number, lines, the prose paragraph right before) of every table and
    fenced block outside the rendered blocks; rendered blocks are blanked (their own test
    checks them), keeping line numbers."""
    text = results_io.BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    lines, out, i, prose = text.split("\n"), [], 0, ""
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            j = next(
                (k for k in range(i + 1, len(lines)) if lines[k].startswith("```")), len(lines)
            )
            out.append((i + 1, lines[i + 1 : j], prose))
            i, prose = j + 1, ""
        elif line.startswith("|"):
            j = next((k for k in range(i, len(lines)) if not lines[k].startswith("|")), len(lines))
            out.append((i + 1, lines[i:j], prose))
            i, prose = j, ""
        elif line.strip():
            j = next(
                (
                    k
                    for k in range(i, len(lines))
                    if not lines[k].strip() or lines[k].startswith(("|", "```"))
                ),
                len(lines),
            )
            prose = "\n".join(lines[i:j])
            i = j
        else:
            i += 1
    return out


RESULTS_REF = re.compile(r"bench/results/([a-z0-9_]+)\.json")


def _cites(line: str) -> bool:
    """A summary row (README's "Measured") that names the results files its figures
    come from, each of which exists; the rendered tables they summarize are checked
    against those files above."""
    names = RESULTS_REF.findall(line)
    return bool(names) and all(results_io.path(n).is_file() for n in names)


def unsupported_figures(doc: Path) -> list[str]:
    """Rows of tables and fenced blocks that quote a bench (the unit or the paragraph
    right before it names ``bench/*.py``), outside every rendered block, that hold a
    figure and carry no "not rerun since" / "not yet run" label: in that paragraph
    (for the whole unit), in a fenced block (for the block), or in the table row itself.
    A fenced line naming the bench is its command line (arguments, not figures) and is
    not itself checked."""
    found = []
    for first, lines, prose in _units(doc.read_text()):
        unit = "\n".join(lines)
        fenced = not (lines and lines[0].startswith("|"))
        if not BENCH_REF.search(unit + prose) or LABEL.search(prose):
            continue
        if fenced and LABEL.search(unit):
            continue
        for n, line in enumerate(lines, start=first + (1 if fenced else 0)):
            if (fenced and BENCH_REF.search(line)) or LABEL.search(line) or _cites(line):
                continue
            if FIGURE.search(line):
                where = doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc.name
                found.append(f"{where}:{n}: {line[:100]}")
    return found


OWNED = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
"""Every doc with bench figures (see unsupported_figures)."""


@pytest.mark.parametrize("doc", OWNED, ids=[d.name for d in OWNED])
def test_every_quoted_bench_figure_has_a_results_file(doc: Path) -> None:
    found = unsupported_figures(doc)
    assert not found, (
        "these rows quote a bench but are neither rendered from a results file "
        "(<!-- NAME:begin --> ... <!-- NAME:end -->, `python bench/NAME.py --render-docs`) "
        'nor labelled "measured at commit X on DATE; not rerun since" / "not yet run":\n'
        + "\n".join(found)
    )


def test_the_rule_flags_an_unrendered_bench_table_and_passes_the_others(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Config defaults (no bench named): the rule leaves them alone.\n\n"
        "| key | default |\n| --- | --- |\n| `train.lr` | 3.0e-4 |\n\n"
        "`python bench/demo.py` measured:\n\n"
        "| row | s/step |\n| --- | ---: |\n| fsdpkit | 0.213 |\n| control | 1.04x |\n\n"
        "`bench/demo.py` at commit abc on 2026-12-01, not rerun since:\n\n"
        "| row | s/step |\n| --- | ---: |\n| old | 0.5 |\n\n"
        "```\n$ python bench/demo.py --reps 6 --elements 50e6\nfused 4.19x\n```\n\n"
        "<!-- demo:begin -->\n`bench/demo.py`\n\n| row | 1.5 MiB |\n<!-- demo:end -->\n\n"
        "| `bench/demo.py` | GPU only | not yet run |\n"
    )
    assert [f.split(": ", 1)[0] for f in unsupported_figures(doc)] == [
        "doc.md:11", "doc.md:12", "doc.md:22",
    ]  # fmt: skip
