"""``fsdpkit train`` end to end, through a subprocess, as a user runs it."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from clirun import FAST, fsdpkit, losses, metrics

pytestmark = pytest.mark.e2e

FIELDS = {
    "step",
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "mfu",
    "peak_mem_mib",
    "peak_mem_kind",
    "step_time_s",
}


@pytest.mark.slow
def test_default_run_trains_and_loss_falls(tmp_path: Path) -> None:
    result = fsdpkit("train", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "default"
    records = metrics(run_dir)
    assert len(records) == 300
    assert set(records[0]) >= FIELDS
    assert records[0]["mfu"] is None  # CPU: no invented peak
    first = sum(r["loss"] for r in records[:10]) / 10
    last = sum(r["loss"] for r in records[-10:]) / 10
    assert last < first - 1.0, (first, last)
    assert "summary" in result.stdout and "sample:" in result.stdout
    assert (run_dir / "config.toml").is_file()
    assert (run_dir / "report.html").is_file() and (run_dir / "plots" / "loss.png").is_file()


def test_resolved_config_reproduces_the_run(tmp_path: Path) -> None:
    first = fsdpkit("train", *FAST, f"logging.run_dir={tmp_path / 'a'}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    config = tmp_path / "a" / "config.toml"
    again = fsdpkit("train", str(config), f"logging.run_dir={tmp_path / 'b'}", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    assert len(losses(tmp_path / "a")) == 12


def test_torchrun_join_matches_spawn(tmp_path: Path) -> None:
    spawned = fsdpkit(
        "train", "--nproc", "2", *FAST, f"logging.run_dir={tmp_path / 's'}", cwd=tmp_path
    )
    assert spawned.returncode == 0, spawned.stderr[-3000:]
    joined = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "fsdpkit",
            "train",
            *FAST,
            f"logging.run_dir={tmp_path / 'j'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert joined.returncode == 0, joined.stderr[-3000:]
    assert losses(tmp_path / "j") == losses(tmp_path / "s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_nodes_on_one_machine_match_single_node(tmp_path: Path) -> None:
    single = fsdpkit(
        "train", "--nproc", "2", *FAST, f"logging.run_dir={tmp_path / 'one'}", cwd=tmp_path
    )
    assert single.returncode == 0, single.stderr[-3000:]
    endpoint = f"127.0.0.1:{_free_port()}"
    args = [
        "train",
        "--nnodes",
        "2",
        "--nproc",
        "1",
        "--rdzv-endpoint",
        endpoint,
        *FAST,
        f"logging.run_dir={tmp_path / 'two'}",
    ]
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "fsdpkit", *args],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [n.communicate(timeout=240) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [o[1][-2000:] for o in outs]
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-6)


def test_awkward_data_size_gives_every_rank_the_same_batches(tmp_path: Path) -> None:
    data = tmp_path / "odd.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 157 + "x" * 13)
    result = fsdpkit(
        "train",
        "--nproc",
        "3",
        *FAST,
        f"data.path={data}",
        "data.seq_len=32",
        "train.steps=40",
        f"logging.run_dir={tmp_path / 'r'}",
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(losses(tmp_path / "r")) == 40


def test_user_factory_model_trains(tmp_path: Path) -> None:
    # parallel.auto plans the factory model by tracing it (issue 10: it used to say
    # "no configuration of this model fits" even on 1000 GiB)
    result = fsdpkit(
        "train",
        *FAST,
        "model.factory=factories:token_mlp",
        "parallel.auto=true",
        "parallel.device_mem=cpu:1000GiB",
        "train.steps=30",
        "train.lr=1e-2",
        f"logging.run_dir={tmp_path / 'f'}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fsdpkit train: parallel.auto chose " in result.stdout, result.stdout[:2000]
    assert "4 x ResidualMLP units" in result.stdout
    got = losses(tmp_path / "f")
    assert sum(got[-5:]) / 5 < sum(got[:5]) / 5 - 0.5


def test_parallel_auto_applies_the_planners_choice(tmp_path: Path) -> None:
    # The default tiny model needs ~69 MiB per rank as configured: on a 60 MiB "device"
    # the planner must change something (checkpointing, micro-batch...) to fit.
    result = fsdpkit(
        "train",
        "parallel.auto=true",
        "parallel.device_mem=cpu:60MiB",
        "train.steps=3",
        "train.sample_tokens=0",
        "checkpoint.resume=never",
        f"logging.run_dir={tmp_path / 'auto'}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    chosen = result.stdout.split("parallel.auto chose ", 1)[1].splitlines()[0]
    assert "=" in chosen, result.stdout[:2000]
    resolved = (tmp_path / "auto" / "config.toml").read_text()
    for item in chosen.split():
        key, value = item.split("=", 1)
        assert f"{key.split('.')[1]} = {value}" in resolved, (item, resolved)


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("model.preset=nope", "model.preset: unknown preset 'nope'; choose one of"),
        ("model.experts=4", "model.experts sizes the experts of a mixture-of-experts preset"),
    ],
)
def test_a_bad_builtin_model_is_one_paragraph_before_any_worker(
    tmp_path: Path, override: str, says: str
) -> None:
    """The launcher checks the preset by the rule the worker builds it with: no worker
    starts (the error is not a rank's) and no run directory is made."""
    run = fsdpkit("train", override, f"logging.run_dir={tmp_path / 'bad'}", cwd=tmp_path)
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"fsdpkit train: error: {says}" in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "bad").exists()
