"""``fsdpkit plan`` as a user runs it: tables, JSON, recommendations, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from clirun import fsdpkit

pytestmark = pytest.mark.e2e

LLAMA8B = ["model.preset=llama3-8b", "data.seq_len=8192", "train.micro_batch_size=2"]


def test_plan_json_for_scripts(tmp_path: Path) -> None:
    result = fsdpkit(
        "plan",
        *LLAMA8B,
        "activations.mode=full",
        "--world-size",
        "8",
        "--device-mem",
        "h100",
        "--json",
        cwd=tmp_path,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout)["plan"]
    assert out["fits"] is True
    assert out["scenario"]["precision"] == "bf16"
    peak = out["memory"]["peak"]
    assert peak["phase"] == "backward" and sum(peak["breakdown"].values()) == peak["bytes"]
    assert out["comm"]["all_gather"] > 0 and out["comm"]["reduce_scatter"] > 0


def test_plan_table_and_recommendation(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text('[model]\npreset = "llama3-8b"\n[data]\nseq_len = 8192\n')
    result = fsdpkit(
        "plan",
        str(config),
        "train.micro_batch_size=2",
        "--world-size",
        "8",
        "--device-mem",
        "80GiB",
        "--recommend",
        cwd=tmp_path,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "DOES NOT FIT" in out  # no activation checkpointing at 2 x 8192
    assert "sharded parameters" in out and "communication per rank" in out
    assert "set in your config (TOML):" in out and "[activations]" in out


def test_traced_plan_from_the_cli(tmp_path: Path) -> None:
    result = fsdpkit("plan", "--world-size", "4", "--trace", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "traced" in result.stdout and "analytic" in result.stdout


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (
            ["parallel.strategy=hybrid", "parallel.shard_degree=3", "--world-size", "8"],
            ["parallel.shard_degree", "world size 8"],
        ),
        (["--device-mem", "h10"], ["--device-mem", "'h10'", "h100"]),
        (["train.micro_batch_size=0"], ["train.micro_batch_size", "> 0"]),
    ],
)
def test_bad_input_exits_2_naming_the_field(
    tmp_path: Path, args: list[str], expect: list[str]
) -> None:
    result = fsdpkit("plan", *args, cwd=tmp_path, timeout=60)
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr
    for text in expect:
        assert text in result.stderr, result.stderr
