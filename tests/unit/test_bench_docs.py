"""Figures in the docs are the results files' own: every rendered block in README.md,
BENCHMARKS.md and docs/*.md (``<!-- NAME:begin -->`` ... ``<!-- NAME:end -->``, see
bench/results_io.py) equals what ``bench/NAME.py``'s ``render`` makes of the committed
``bench/results/NAME.json``, and that file says how, where and when it was measured."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).parents[2]
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
sys.path.insert(0, str(ROOT / "bench"))
import results_io  # noqa: E402


def _bench(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None, f"bench/{name}.py is missing"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BLOCKS = [(doc, name, text) for doc in DOCS for name, text in results_io.blocks(doc)]


def test_the_docs_have_rendered_blocks() -> None:
    assert {name for _, name, _ in BLOCKS} >= {"data_scale"}


@pytest.mark.parametrize(
    ("doc", "name", "text"), BLOCKS, ids=[f"{d.name}:{n}" for d, n, _ in BLOCKS]
)
def test_block_is_rendered_from_its_results_file(doc: Path, name: str, text: str) -> None:
    results = results_io.read(name)
    for key in ("command", "commit", "machine", "date"):
        assert results.get(key), f"bench/results/{name}.json has no {key!r}"
    assert text == _bench(name).render(results).rstrip("\n") + "\n", (
        f"{doc.name}'s {name} block differs from its results file: run "
        f"`python bench/{name}.py --render-docs`"
    )
