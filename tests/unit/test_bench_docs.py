"""Figures in the docs are the results files' own: each rendered table equals what its
bench renders from the committed results (no retyped numbers)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).parents[2]


def _bench(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_data_scale_table_is_rendered_from_its_results_file() -> None:
    bench = _bench("data_scale")
    results = json.loads(bench.RESULTS.read_text())
    text = bench.DOCS.read_text()
    block = text[text.index(bench.BEGIN) + len(bench.BEGIN) : text.index(bench.END)]
    assert block == "\n" + bench.render(results)
    for key in ("command", "commit", "machine", "date", "load_avg_1_5_15"):
        assert results[key], key
