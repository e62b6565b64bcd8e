"""Observability end to end: one real 2-rank `fsdpkit train` run with TensorBoard, the
profiler, checkpoints, W&B offline (the dev extra installs wandb) and the end-of-run
report, then
`fsdpkit report` on it and on two runs compared, and the page in headless Chromium
wherever Chromium is installed."""

from __future__ import annotations

import html
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from clirun import FAST, fsdpkit, metrics

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROFILED = (5, 6)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("observe")
    run = tmp / "run"
    result = fsdpkit(
        "train",
        *FAST,
        "checkpoint.every=6",
        "logging.report=true",
        "logging.tensorboard=true",
        f"logging.profile_steps=[{PROFILED[0]},{PROFILED[1]}]",
        "logging.wandb=offline",
        "logging.progress=lines",
        f"logging.run_dir={run}",
        cwd=tmp,
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"report: {run}/report.html" in result.stdout
    assert "profiled steps 5-6" in result.stdout  # the breakdown table, printed by rank 0
    assert "mem " in result.stdout and "ETA" in result.stdout  # progress lines
    return run


def _png_ok(path: Path) -> None:
    import matplotlib.image

    pixels = matplotlib.image.imread(path)
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100, path
    assert pixels.std() > 0.01, f"{path} is blank"


def test_report_plots_and_page(run_dir: Path) -> None:
    plots = sorted(p.name for p in (run_dir / "plots").glob("*.png"))
    assert plots == [
        "checkpoint_blocking.png",
        "grad_norm.png",
        "loss.png",
        "lr.png",
        "memory.png",
        "step_breakdown.png",
        "tokens_per_s.png",
    ]
    for name in plots:
        _png_ok(run_dir / "plots" / name)
    page = html.unescape((run_dir / "report.html").read_text())
    for name in plots:
        assert f'href="plots/{name}"' in page
    assert page.count("data:image/png;base64,") == len(plots)  # self-contained
    assert 'preset = "tiny"' in page and "steps = 12" in page  # the resolved config
    assert "logical_cpus" in page and "torch" in page  # hardware
    assert "final validation loss" in page
    hardware = json.loads((run_dir / "hardware.json").read_text())
    assert hardware["world_size"] == 2 and hardware["device_type"] == "cpu"


def test_tensorboard_has_the_loss_of_every_logged_step(run_dir: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    logged = {r["step"]: r["loss"] for r in metrics(run_dir)}
    scalars = {e.step: e.value for e in events.Scalars("train/loss")}
    assert sorted(scalars) == sorted(logged) == list(range(1, 13))
    for step, loss in logged.items():
        assert scalars[step] == pytest.approx(loss, rel=1e-6)
    assert {"val/loss", "train/lr", "memory/peak_mib_rank1"} <= set(events.Tags()["scalars"])


def _wandb_history(run_dir: Path) -> dict[int, dict[str, float]]:
    """The history records of the run's offline ``.wandb`` file, by step: the file is a
    LevelDB-style log (a 7-byte file header, then 32 KiB blocks of chunks with a 7-byte
    header: crc32, little-endian length, kind 1 full / 2 first / 3 middle / 4 last),
    each record a ``wandb_internal_pb2.Record``. wandb has no public offline reader."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", path
    pos, chunk, history = 7, b"", {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the block's tail is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record.FromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                values = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
                history[record.history.step.num] = values
    return history


def test_wandb_offline_run_has_the_loss_of_every_logged_step(run_dir: Path) -> None:
    """WandbSink really ran: the offline run holds each step's logged loss."""
    history = _wandb_history(run_dir)
    logged = {r["step"]: r["loss"] for r in metrics(run_dir)}
    assert sorted(history) == sorted(logged) == list(range(1, 13))
    for step, loss in logged.items():
        assert history[step]["train/loss"] == pytest.approx(loss, rel=1e-6), step


def test_profiler_trace_and_breakdown(run_dir: Path) -> None:
    measured = {r["step"]: r["step_time_s"] * 1000 for r in metrics(run_dir)}
    breakdown = json.loads((run_dir / "profile" / "breakdown.json").read_text())
    assert [b["rank"] for b in breakdown] == [0, 1]
    for rank in breakdown:
        trace = json.loads((run_dir / "profile" / f"trace-rank{rank['rank']}.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert {"fsdpkit.step#5", "fsdpkit.step#6", "fsdpkit.data"} <= names
        assert any(n.startswith("Optimizer.step#AdamW") for n in names)
        assert any(n.startswith("FSDP::all_gather") for n in names)
        assert any(n.startswith("gloo:") for n in names)  # the collectives themselves
        assert [s["step"] for s in rank["steps"]] == list(range(PROFILED[0], PROFILED[1] + 1))
        for step in rank["steps"]:
            ms = step["ms"]
            total = sum(ms[c] for c in ("compute", "all_gather", "reduce_scatter",
                                        "all_reduce", "optimizer", "data", "other"))  # fmt: skip
            # Each rank's own step time; rank 0's is the one in metrics.jsonl.
            assert total == pytest.approx(step["measured_ms"], rel=0.10), step
            if rank["rank"] == 0:
                assert step["measured_ms"] == pytest.approx(measured[step["step"]], rel=1e-6)
            assert ms["compute"] > 0 and ms["all_gather"] + ms["reduce_scatter"] > 0
            assert 0 < ms["comm_exposed"] <= ms["comm_total"] + 1e-6
        assert rank["peak_tensor_mib"] > 1  # process-wide c10 accounting on CPU
    assert "comm-exposed" in (run_dir / "profile" / "breakdown.txt").read_text()


def test_report_command_compares_runs(run_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(run_dir, other, ignore=shutil.ignore_patterns("checkpoints", "wandb"))
    out = tmp_path / "compare"
    both = fsdpkit("report", str(run_dir), str(other), "-o", str(out), cwd=tmp_path)
    assert both.returncode == 0, both.stderr
    page = (out / "report.html").read_text()
    assert "fsdpkit report: run, other" in page
    _png_ok(out / "plots" / "loss.png")
    missing = fsdpkit("report", str(run_dir), str(other), cwd=tmp_path)
    assert missing.returncode == 2 and "-o DIR" in missing.stderr


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed")
def test_report_renders_in_headless_chromium(run_dir: Path, tmp_path: Path) -> None:
    """The page as a person sees it: screenshot, then check the plots are painted."""
    shot = tmp_path / "shot.png"
    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    flags = "--headless --no-sandbox --disable-gpu --disable-quic --no-first-run "
    flags += "--disable-background-networking --disable-component-update --disable-sync"
    subprocess.run(
        ["chromium", *flags.split(), f"--user-data-dir={profile}", "--window-size=1200,1400",
         f"--screenshot={shot}", (run_dir / "report.html").as_uri()],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)[:, :, :3]
    # The plot row under the summary: matplotlib's default blue line (#1f77b4) is drawn.
    blue = (abs(pixels[:, :, 0] - 0x1F / 255) < 0.05) & (abs(pixels[:, :, 2] - 0xB4 / 255) < 0.05)
    assert blue.sum() > 150, "no plot lines in the rendered page"
