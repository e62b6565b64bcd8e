"""Observability pure logic: the step-time breakdown, reading run dirs, scalar tags,
the progress line, config validation, and the report's missing-matplotlib message."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from fsdpkit import config as configuration
from fsdpkit.config import ConfigError
from fsdpkit.observe import report as report_module
from fsdpkit.observe.breakdown import CATEGORIES, comm_kind, step_breakdown
from fsdpkit.observe.runlog import RunLogError, load_run
from fsdpkit.observe.sinks import scalars
from fsdpkit.train.progress import Progress

MAIN, GLOO = 1, 2


def ev(name: str, ts: float, dur: float, tid: int = MAIN) -> dict[str, object]:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 0}


def test_breakdown_partitions_the_step_by_priority() -> None:
    # One 100 us step: data 0-10, forward op 10-40, an all-gather issued at 40-42 that
    # runs on a gloo thread 41-60 (main idle 42-60: exposed 18, plus the 2 us issue),
    # a reduce-scatter issued 60-61 running as gloo:all_reduce 61-80 under compute
    # 61-90 (hidden), optimizer 90-98, and 2 us of nothing at the end.
    events = [
        ev("fsdpkit.step#3", 0, 100),
        ev("fsdpkit.data", 0, 10),
        ev("aten::mm", 10, 30),
        ev("c10d::_allgather_base_", 40, 2),
        ev("gloo:all_gather", 41, 19, tid=GLOO),
        ev("c10d::_reduce_scatter_base_", 60, 1),
        ev("gloo:all_reduce", 61, 19, tid=GLOO),
        ev("aten::mm", 61, 29),
        ev("autograd::engine::evaluate_function: MmBackward0", 61, 29),  # not compute
        ev("Optimizer.step#AdamW.step", 90, 8),
        ev("aten::add_", 91, 2),  # inside the optimizer: counted as optimizer
    ]
    (step,) = step_breakdown(events)
    ms = {k: round(v * 1000, 6) for k, v in step["ms"].items()}  # back to us
    assert step["step"] == 3 and step["span_ms"] == pytest.approx(0.1)
    assert ms["data"] == 10 and ms["optimizer"] == 8
    assert ms["all_gather"] == 20  # 2 issue + 18 waiting
    assert ms["reduce_scatter"] == 1  # only the issue; the rest ran under compute
    assert ms["compute"] == 30 + 29
    assert ms["other"] == 2
    assert sum(ms[c] for c in CATEGORIES) == pytest.approx(100)
    assert ms["comm_exposed"] == 21
    assert ms["comm_total"] == 40  # 40-80: issue and execution of both collectives
    # hidden behind compute: comm_total - comm_exposed = the reduce-scatter's 61-80


def test_comm_kind_names() -> None:
    assert comm_kind("c10d::_allgather_base_") == "all_gather"
    assert comm_kind("c10d::reduce_scatter_tensor_coalesced_") == "reduce_scatter"
    assert comm_kind("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL") == "reduce_scatter"
    assert comm_kind("c10d::allreduce_") == "all_reduce"
    assert comm_kind("c10d::broadcast_") == "all_reduce"
    assert comm_kind("_c10d_functional::wait_tensor") is None
    assert comm_kind("aten::mm") is None


def test_breakdown_without_step_annotations_is_empty() -> None:
    assert step_breakdown([ev("aten::mm", 0, 5)]) == []


def test_run_log_series_summary_and_torn_lines(tmp_path: Path) -> None:
    lines = [
        {"step": 1, "loss": 5.0, "lr": 1e-3, "grad_norm": 2.0, "tokens_per_s": 10.0,
         "step_time_s": 1.0, "peak_mem_mib": [100.0, 90.0], "peak_mem_kind": "cpu_max_rss"},
        {"step": 2, "loss": 4.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 30.0,
         "step_time_s": 0.5, "peak_mem_mib": [110.0, 95.0], "peak_mem_kind": "cpu_max_rss"},
        {"step": 2, "val_loss": 4.5},
        {"step": 2, "checkpoint_blocking_s": 0.25},
        {"step": 3, "loss": 3.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 50.0,
         "step_time_s": 0.3, "peak_mem_mib": [120.0, 99.0], "peak_mem_kind": "cpu_max_rss"},
    ]  # fmt: skip
    text = "".join(json.dumps(r) + "\n" for r in lines) + '{"step": 4, "lo'
    (tmp_path / "metrics.jsonl").write_text(text)
    (tmp_path / "config.toml").write_text("[train]\nsteps = 3\n")
    run = load_run(tmp_path)
    assert run.series["loss"].steps == [1, 2, 3]
    assert run.series["val_loss"].values == [4.5]
    assert run.memory[1].values == [90.0, 95.0, 99.0]
    assert run.config["train"]["steps"] == 3
    s = run.summary
    assert s["steps"] == 3 and s["final_loss"] == 3.0 and s["best_val_loss"] == 4.5
    assert s["tokens_per_s_median"] == 40.0  # first step left out
    assert s["peak_mem_mib_per_rank"] == [120.0, 99.0]
    assert s["checkpoints"] == 1 and s["checkpoint_blocking_s_total"] == 0.25
    with pytest.raises(RunLogError, match=r"no metrics\.jsonl"):
        load_run(tmp_path / "nope")


def _grpo_run(path: Path) -> Path:
    """A GRPO run directory: rl/* per step, held-out reward and pass rate at step 2."""
    steps = [
        {"step": n, "loss": 0.01 * n, "rl/reward": r, "rl/pass_rate": r,
         "rl/logprob_gap_max": 2e-6, "rl/logprob_gap_mean": 3e-7, "rl/entropy": 0.9}
        for n, r in ((1, 0.25), (2, 0.5), (3, 0.75))
    ]  # fmt: skip
    evals = [{"step": 2, "val_reward": 0.4, "val_pass_rate": 0.4}]
    lines = [*steps[:2], *evals, steps[2], {"step": 3, "val_reward": 0.7, "val_pass_rate": 0.7}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (path / "config.toml").write_text("[rl]\nlogprob_gap_max = 0.01\n")
    return path


def test_a_grpo_run_reads_its_reward_pass_rate_and_gap_series(tmp_path: Path) -> None:
    run = load_run(_grpo_run(tmp_path))
    assert run.series["rl/reward"].values == [0.25, 0.5, 0.75]
    assert run.series["rl/logprob_gap_max"].steps == [1, 2, 3]
    assert run.series["val_pass_rate"].steps == [2, 3]
    assert run.summary["final_val_pass_rate"] == 0.7
    assert run.summary["final_loss"] == pytest.approx(0.03)


def test_a_grpo_report_plots_reward_pass_rate_and_gap(tmp_path: Path) -> None:
    page = report_module.write_report([_grpo_run(tmp_path)])
    plots = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert {"rl_reward.png", "rl_pass_rate.png", "logprob_gap.png", "loss.png"} <= set(plots)
    assert "rewards.png" not in plots  # DPO's, drawn only with its series
    text = page.read_text()
    assert "GRPO pass rate" in text and "final held-out pass rate (GRPO)" in text
    assert "70.0%" in text


def test_scalar_tags() -> None:
    values = scalars({"step": 3, "loss": 2.0, "mfu": None, "peak_mem_mib": [1.0, 2.0]})
    assert values == {
        "train/loss": 2.0,
        "memory/peak_mib_rank0": 1.0,
        "memory/peak_mib_rank1": 2.0,
    }
    grpo = scalars({"step": 4, "rl/reward": 0.5, "rl/rewards/exact": 1, "val_pass_rate": 0.25})
    assert grpo == {"rl/reward": 0.5, "rl/rewards/exact": 1.0, "val/pass_rate": 0.25}


def test_grpo_metrics_reach_the_sinks_under_their_own_tags() -> None:
    record = {"step": 2, "rl/reward": 0.5, "rl/logprob_gap_max": 1e-6, "val_pass_rate": 0.25}
    assert scalars(record) == {
        "rl/reward": 0.5,
        "rl/logprob_gap_max": 1e-6,
        "val/pass_rate": 0.25,
    }


def test_progress_line_shows_memory_per_rank() -> None:
    out = io.StringIO()
    p = Progress(total=10, start=0, mode="lines", enabled=True, stream=out)
    p.update(step=1, loss=2.5, tokens_per_s=1234.0, mem_mib=[812.4, 815.0])
    p.update(step=10, loss=2.0, tokens_per_s=1234.0, mem_mib=[float(m) for m in range(8)])
    first, last = out.getvalue().splitlines()
    assert "step 1/10" in first and "1,234 tok/s" in first and "ETA" in first
    assert first.endswith("mem 812/815 MiB")
    assert last.endswith("mem 0-7 MiB (8 ranks)")


def test_profile_steps_validation() -> None:
    cfg = configuration.load(None, ["train.steps=10", "logging.profile_steps=[3,4]"])
    assert cfg.logging.profile_steps == [3, 4]
    for bad in ("[4,3]", "[0,2]", "[5]", "[9,11]"):
        with pytest.raises(ConfigError, match=r"logging\.profile_steps"):
            configuration.load(None, ["train.steps=10", f"logging.profile_steps={bad}"])
    with pytest.raises(ConfigError, match=r"logging\.wandb"):
        configuration.load(None, ["logging.wandb=cloud"])


def test_report_without_matplotlib_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    real = report_module.importlib.util.find_spec
    monkeypatch.setattr(
        report_module.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    with pytest.raises(report_module.ReportUnavailable, match=r"fsdpkit\[report\]"):
        report_module.write_report([tmp_path])
    with pytest.raises(RunLogError, match="-o DIR"):
        report_module.write_report([tmp_path, tmp_path])
