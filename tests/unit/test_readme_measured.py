"""README's "Measured" table quotes only what results files hold. Every row names the
``bench/results/*.json`` its figures come from (each must exist), and each figure in
the row (a decimal, or digits with a unit, a percent or an "x"; and every "N of M"
count) is found in those files: a value at the precision shown (a fraction also as a
percent), text in them, or text their bench renders from them (``bench/NAME.py``'s
``render``, whose tables tests/unit/test_bench_docs.py ties to the same files). A
figure retyped from an old run, rounded wrong or counted wrong fails here."""

from __future__ import annotations

import json
import math
import re
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import results_io  # noqa: E402

RESULTS_REF = re.compile(r"bench/results/([a-z0-9_]+)\.json")
FIGURE = re.compile(
    r"(?<![\w.])(\d[\d,]*\.\d+(?:e[-+]?\d+)?|\d+(?:\.\d+)?e[-+]?\d+|\d[\d,]*(?=\s?(?:%|x\b|MiB"
    r"|GiB|MB\b|GB\b|ms\b|s\b|tok/s)))"
)
"""A measured-looking number: a decimal, or digits with a unit, a percent or an 'x'."""
COUNT = re.compile(r"\b\d+ of \d+\b")
LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")


def measured_rows(text: str) -> list[tuple[int, str]]:
    """(line number, line) of each body row of the table under "## Measured"."""
    lines = text.split("\n")
    start = lines.index("## Measured")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    table = [(n + 1, lines[n]) for n in range(start, end) if lines[n].startswith("|")]
    return table[2:]  # the header and its rule


@cache
def _leaves(name: str) -> tuple[list[float], list[str]]:
    numbers: list[float] = []
    strings: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, bool):
            return
        if isinstance(value, int | float):
            numbers.append(float(value))
        elif isinstance(value, str):
            strings.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(json.loads(results_io.path(name).read_text()))
    return numbers, strings


@cache
def _rendered(name: str) -> str:
    """What ``bench/NAME.py`` renders from its results file ('' without a render)."""
    if not (results_io.BENCH / f"{name}.py").is_file():
        return ""
    render = getattr(results_io.bench(name), "render", None)
    return render(results_io.read(name)) if render else ""


def _half_unit(token: str) -> float:
    """Half a unit in the last digit ``token`` shows (its rounding interval)."""
    mantissa, _, exponent = token.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 0.5 * 10.0 ** (-decimals + (int(exponent) if exponent else 0))


def _as_text(token: str, text: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(token)}(?![\d])", text) is not None


def found(token: str, names: list[str]) -> bool:
    """``token`` is a value of the files ``names`` (as shown, or a fraction shown as a
    percent), text in them, or text rendered from them."""
    value, tolerance = float(token.replace(",", "")), _half_unit(token.replace(",", ""))
    for name in names:
        numbers, strings = _leaves(name)
        for v in numbers:
            if any(math.isclose(x, value, abs_tol=tolerance * 1.0001) for x in (v, 100 * v)):
                return True
        if any(_as_text(token, s) for s in [*strings, _rendered(name)]):
            return True
    return False


def unfound(line: str) -> list[str]:
    """The figures of a README "Measured" row that its cited results files do not hold."""
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    names = RESULTS_REF.findall(cells[-1])
    if not names or not all(results_io.path(n).is_file() for n in names):
        return [f"cites no results file that exists: {cells[-1]!r}"]
    text = LINK.sub(r"\1", " | ".join(cells[:-1]))
    missing = [t for t in FIGURE.findall(text) if not found(t, names)]
    corpus = " ".join(_rendered(n) + " ".join(_leaves(n)[1]) for n in names)
    return missing + [c for c in COUNT.findall(text) if c not in corpus]


README = (ROOT / "README.md").read_text()
ROWS = measured_rows(README)


def test_the_readme_has_a_measured_table() -> None:
    assert len(ROWS) >= 5, ROWS


@pytest.mark.parametrize(("number", "line"), ROWS, ids=[f"README.md:{n}" for n, _ in ROWS])
def test_every_measured_figure_is_in_its_results_file(number: int, line: str) -> None:
    missing = unfound(line)
    assert not missing, (
        f"README.md:{number}: figures its results files ({', '.join(RESULTS_REF.findall(line))})"
        f" do not hold: {missing}. Quote them as the file (or its bench's rendered table) "
        "has them, or rerun the bench"
    )


def test_the_rule_catches_a_retyped_figure_and_a_wrong_count() -> None:
    good = "| GPU | within 0.3%; 24 of 30 rows hold; 13.9 ms | `bench/results/gpu_check.json` |"
    assert unfound(good) == []
    assert unfound(good.replace("13.9 ms", "12.9 ms")) == ["12.9"]
    assert unfound(good.replace("24 of 30", "26 of 29")) == ["26 of 29"]
    assert unfound("| x | 1.5 GiB | none |") == ["cites no results file that exists: 'none'"]
