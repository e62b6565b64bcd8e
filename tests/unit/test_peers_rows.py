"""The settings bench/peers.py and bench/train_throughput.py give each row (the same
AdamW kernel everywhere at the shared settings, defaults rows labelled and paired with
their framework's shared row), the kernel recorded as built, and the tables rendered
from a results file (shared and defaults rows apart, the A/A control, '-' for
nothing measured)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from peerlib import tables
from peerlib.common import Spec, adamw, adamw_kwargs, kernel_of
from peerlib.rows import BASELINE, CONTROL, REFERENCE, ROWS, SHARED_ADAMW, cli_adamw

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_every_shared_row_steps_the_shared_kernel_and_loss() -> None:
    shared = {k: r for k, r in ROWS.items() if not r.defaults}
    assert {BASELINE, CONTROL, REFERENCE, "fsdpkit-train", "fsdpkit-api"} <= set(shared)
    assert all(r.adamw == SHARED_ADAMW and "full fp32 logits" in r.loss for r in shared.values())
    assert cli_adamw(ROWS["fsdpkit-train"]) == "torch fused (train.optimizer_impl=fused)"
    assert "train.chunked_loss=off" in ROWS["fsdpkit-train"].cli


def test_defaults_rows_name_their_shared_twin() -> None:
    defaults = {k: r for k, r in ROWS.items() if r.defaults}
    assert set(defaults) == {"fsdpkit-defaults", "torch-defaults", "deepspeed-defaults"}
    for row in defaults.values():
        assert row.shared_twin in ROWS and not ROWS[row.shared_twin].defaults
    assert ROWS["fsdpkit-defaults"].cli == ()  # nothing overridden: fsdpkit's own choices
    assert cli_adamw(ROWS["fsdpkit-defaults"]) == "torch fused (train.optimizer_impl=auto)"
    assert ROWS["torch-defaults"].adamw == "default"


@pytest.mark.parametrize(
    ("choice", "kernel"),
    [
        ("fused", "torch fused"),
        ("foreach", "torch foreach"),
        ("for-loop", "torch for-loop"),
        ("default", "torch for-loop (torch's CPU default)"),
    ],
)
def test_the_kernel_is_passed_and_recorded_as_built(choice: str, kernel: str) -> None:
    model = torch.nn.Linear(4, 3)
    opt = adamw(model, Spec(adamw=choice))
    assert kernel_of(opt) == kernel
    assert kernel_of(SimpleNamespace(optimizer=opt)) == kernel  # a framework's wrapper
    decays = [g["weight_decay"] for g in opt.param_groups]
    assert decays == [0.1, 0.0]  # the matrix decays, the bias does not


def test_an_unknown_kernel_is_refused() -> None:
    with pytest.raises(ValueError, match=r"Spec\.adamw = 'fast'"):
        adamw_kwargs(Spec(adamw="fast"))


def _row(key: str, *, defaults: bool, tps: float | None, ratio: float | None) -> dict:
    return {
        "key": key, "label": f"L-{key}", "defaults": defaults, "adamw": "torch fused",
        "loss": "full", "units": "blocks", "median": tps, "low": tps, "high": tps,
        "ratio": [ratio, ratio, ratio], "vs_shared": [0.5, 0.4, 0.6] if defaults else None,
        "peak_mib": [68.5, 68.5] if tps else [], "shard_fraction": 0.5 if tps else None,
        "max_loss_diff": 1e-7 if tps else None, "wall_s": [10.0, 12.0, 20.0] if tps else [],
        "verdict": "ok" if tps else "failed: ImportError", "note": "",
    }  # fmt: skip


def test_render_puts_shared_and_defaults_rows_in_their_own_tables() -> None:
    results = {
        "machine": "vm x86_64 2 cores", "reps": 4, "minutes": 12.3, "control": "hand-B",
        "spec": {"steps": 8, "warmup": 2}, "load_1min_per_rep": [3.0, 5.5],
        "rows": [
            _row("hand-A", defaults=False, tps=2000.0, ratio=1.0),
            _row("hand-B", defaults=False, tps=1960.0, ratio=0.98),
            _row("deepspeed", defaults=False, tps=None, ratio=None),
            _row("torch-defaults", defaults=True, tps=1000.0, ratio=0.5),
        ],
    }  # fmt: skip
    text = tables.render(results, provenance="PROV")
    shared, defaults = text.split("**At each framework's own defaults**")
    assert "| L-hand-B | 1,960 | 1,960-1,960 | 0.980 (0.98-0.98) | 68.5 / 68.5 | 1/2 |" in shared
    assert "| L-deepspeed | - | - | - | - | - | - | - | failed: ImportError |" in shared
    assert "A/A control: hand-written B / A = 0.980 (0.98-0.98)" in shared
    assert (
        "| L-torch-defaults | 1,000 | 1,000-1,000 | 0.500 (0.50-0.50) | 0.500 (0.40-0.60) |"
        in defaults
    )
    assert "L-torch-defaults" not in shared.split("**At the shared settings**")[1]
    assert "load average after each repetition was 3.0-5.5 on 2 cores" in text
    assert "| 12 | ok |" in text  # median seconds per launch


def _bench(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_throughput_rows_pair_and_compare_losses_with_hand_a() -> None:
    tt = _bench("train_throughput")
    loss = [5.0, 4.0]
    measured = {
        k: {"tokens_per_s": [100.0, 120.0], "losses": [loss, loss], "wall_s": [10.0, 12.0]}
        for k in tt.ROWS
    }
    measured["kit"] = {
        "tokens_per_s": [110.0, 108.0],
        "losses": [[5.0, 4.0 + 2e-6]],
        "wall_s": [20.0],
    }
    rows = {r["key"]: r for r in tt.rows_of(measured)}
    assert rows["hand-A"]["ratio"] == [1.0, 1.0, 1.0] and rows["hand-A"]["max_loss_diff"] == 0.0
    assert rows["kit"]["ratio"] == [
        pytest.approx(109 / 110),
        pytest.approx(0.9),
        pytest.approx(1.1),
    ]
    assert rows["kit"]["max_loss_diff"] == pytest.approx(2e-6)
    assert "chunked_loss=off" in rows["kit"]["loss"] and "auto" in rows["kit-defaults"]["adamw"]
