"""bench/peers.py's own statistics: run order, medians and ranges, ratios, and the
marking of rows whose loss does not match the reference."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from peerlib.stats import Runs, abba, max_loss_diff, ratio, summarize

REF = [5.0, 4.0, 3.0]


def test_abba_alternates_the_order() -> None:
    assert abba(["a", "b", "c"], 3) == [
        (0, "a"), (0, "b"), (0, "c"),
        (1, "c"), (1, "b"), (1, "a"),
        (2, "a"), (2, "b"), (2, "c"),
    ]  # fmt: skip


def test_medians_ranges_and_ratios() -> None:
    rows = {
        "fsdpkit": Runs(tokens_per_s=[100.0, 120.0, 110.0, 90.0], losses=[REF]),
        "peer": Runs(tokens_per_s=[50.0, 60.0, 55.0, 45.0], losses=[REF, REF]),
        "ref": Runs(tokens_per_s=[200.0, 180.0, 220.0, 210.0], losses=[REF]),
    }
    s = {x.name: x for x in summarize(rows, baseline="fsdpkit", reference="ref")}
    assert s["fsdpkit"].median == 105.0 and (s["fsdpkit"].low, s["fsdpkit"].high) == (90, 120)
    assert s["fsdpkit"].ratio == 1.0
    assert s["peer"].median == 52.5 and s["peer"].ratio == pytest.approx(0.5)
    assert (s["peer"].ratio_low, s["peer"].ratio_high) == (0.5, 0.5)  # paired per repetition
    assert s["ref"].ratio == pytest.approx(205 / 105)
    assert s["ref"].ratio_low == pytest.approx(180 / 120)
    assert s["ref"].ratio_high == pytest.approx(210 / 90)
    assert all(x.verdict == "ok" and x.max_loss_diff == 0.0 for x in s.values())


def test_rows_off_the_reference_loss_are_wrong() -> None:
    close = [5.0, 4.0 + 9e-6, 3.0]
    off = [5.0, 4.0, 3.0 + 2e-5]
    rows = {
        "ref": Runs(tokens_per_s=[1.0], losses=[REF]),
        "close": Runs(tokens_per_s=[1.0], losses=[close]),
        "off": Runs(tokens_per_s=[9.0], losses=[REF, off]),  # one bad repetition is enough
        "nan": Runs(tokens_per_s=[1.0], losses=[[5.0, math.nan, 3.0]]),
        "short": Runs(tokens_per_s=[1.0], losses=[[5.0, 4.0]]),
        "crashed": Runs(error="ImportError: no module named deepspeed"),
    }
    s = {x.name: x for x in summarize(rows, baseline="ref", reference="ref", tol=1e-5)}
    assert s["close"].verdict == "ok"
    assert s["off"].verdict.startswith("WRONG") and s["off"].max_loss_diff == pytest.approx(2e-5)
    assert s["nan"].verdict.startswith("WRONG")
    assert s["short"].verdict.startswith("WRONG") and s["short"].max_loss_diff == math.inf
    assert s["crashed"].verdict == "failed: ImportError: no module named deepspeed"
    assert s["crashed"].median is None and s["crashed"].ratio is None


def test_max_loss_diff_over_repetitions() -> None:
    assert max_loss_diff([REF, [5.0, 4.5, 3.0]], REF) == 0.5


def test_ratio_pairs_each_repetition_with_the_baselines() -> None:
    mid, low, high = ratio([90.0, 110.0, 100.0], [100.0, 100.0, 125.0])
    assert mid == pytest.approx(100 / 100)  # median over median
    assert (low, high) == (pytest.approx(0.8), pytest.approx(1.1))  # 100/125 and 110/100
    assert ratio([], [1.0]) == (None, None, None)
    assert ratio([1.0], []) == (None, None, None)
