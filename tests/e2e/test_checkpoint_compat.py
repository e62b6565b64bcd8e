"""Checkpoints written by fsdpkit 0.1.0 (tests/fixtures/checkpoints, made by its
make_fixtures.py) still resume bit-exactly and export the same tensors, on every later
commit; a format this fsdpkit does not know is refused by name; and a change of what a
checkpoint holds without a new format version fails here ([Note: canonical format
description] in tests/compat_support.py). The policy: docs/compatibility.md.

[Note: compat resumes in-process]
The resumes call the worker's own library path (``resolve`` -> ``build_session`` ->
``train.loop.run``, what ``fsdpkit train`` runs in each worker; the launcher in front
of it reads no checkpoint) under ``run_ranks``: the three 1-rank fixtures one after
another in one process, the 2-rank one beside them. Start-up was most of each CLI
resume (a launcher and a worker per fixture, each importing torch: 28-35 s for the
four at load 0.4-2 on 2 cores, 63-68 s at load 4-6; this way 10-17 s at load 2-3,
23-30 s at load 4-6), which kept this test out of ``make test``. Sharing a process
cannot make a wrong resume pass: the first fixture starts fresh, and state left by an
earlier one could only move a later loss off the value its fresh 0.1.0 run recorded.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from compat_support import (
    FIXTURE_STEP,
    FIXTURES,
    describe_format,
    export_digest,
    metrics_loss,
    train_overrides,
)
from fsdpkit.checkpoint import CheckpointError, read_meta
from fsdpkit.checkpoint.stepdir import VERSION
from fsdpkit.cli import main
from fsdpkit.testing import run_ranks
from fsdpkit.version import __version__

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

FIXTURE_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoints"
EXPECTED = json.loads((FIXTURE_DIR / "expected.json").read_text())
SHARED = ("corpus.txt", "hf-llama")


def _ckpt(run: Path, step: int = FIXTURE_STEP) -> Path:
    return run / "checkpoints" / f"step-{step:08d}"


def _format_file() -> dict:
    path = FIXTURE_DIR / f"format-v{VERSION}.json"
    assert path.is_file(), (
        f"checkpoint format {VERSION} has no description {path.name}: a new format version "
        "needs new fixtures (tests/fixtures/checkpoints/make_fixtures.py) and a paragraph "
        "in docs/compatibility.md on what this release does with the old ones"
    )
    return json.loads(path.read_text())


def _resume(rank: int, world: int, names: list[str], work: str) -> dict[str, int]:
    """Resume each fixture of ``names`` for one step on this rank, as an ``fsdpkit
    train`` worker does ([Note: compat resumes in-process]); name -> steps the run
    reports."""
    from fsdpkit.run.resolve import resolve
    from fsdpkit.runtime.distenv import joined_env
    from fsdpkit.train.loop import run
    from fsdpkit.train.session import build_session

    os.chdir(work)  # the fixtures' paths are relative to their directory
    env = joined_env()
    assert env is not None and env.world_size == world
    done = {}
    for name in names:
        overrides = [*train_overrides(name, steps=FIXTURE_STEP + 1), "logging.progress=none"]
        cfg = resolve(None, overrides, world_size=world, local_world_size=world).config
        done[name] = run(build_session(cfg, env)).steps
    return done


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every fixture copied to a scratch directory and resumed for one step."""
    work = tmp_path_factory.mktemp("compat")
    for name in (*SHARED, *FIXTURES):
        src = FIXTURE_DIR / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, work / name)
    by_world: dict[int, list[str]] = {}
    for name, spec in FIXTURES.items():
        by_world.setdefault(spec["nproc"], []).append(name)
    with ThreadPoolExecutor(len(by_world)) as pool:
        jobs = [
            pool.submit(run_ranks, _resume, world_size=n, args=(names, str(work)), timeout_s=300)
            for n, names in by_world.items()
        ]
        for job in jobs:
            for steps in job.result():
                assert all(v == FIXTURE_STEP + 1 for v in steps.values()), steps
    return {name: work / name for name in FIXTURES}


@pytest.mark.parametrize("name", list(FIXTURES))
def test_fixture_resumes_bit_exactly(resumed: dict[str, Path], name: str) -> None:
    run = resumed[name]
    got = metrics_loss(run / "metrics.jsonl", FIXTURE_STEP + 1)
    assert got == EXPECTED[name]["next_loss"], (
        f"{name}: step {FIXTURE_STEP + 1} after resuming the 0.1.0 checkpoint has loss "
        f"{got!r}, the uninterrupted 0.1.0 run had {EXPECTED[name]['next_loss']!r}"
    )
    history = (FIXTURE_DIR / name / "metrics.jsonl").read_text().splitlines()
    kept = sum(json.loads(line)["step"] <= FIXTURE_STEP for line in history)  # resume keeps
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[:kept] == [json.loads(line) for line in history[:kept]], records
    assert records[kept]["fsdpkit_version"] == __version__, records  # the resume's first
    trained = {r["step"] for r in records[kept:] if "loss" in r}
    assert trained == {FIXTURE_STEP + 1}, f"{name} did not resume from step {FIXTURE_STEP}"


@pytest.mark.parametrize("name", list(FIXTURES))
def test_checkpoint_format_unchanged_or_version_bumped(resumed: dict[str, Path], name: str) -> None:
    """What this commit writes matches the committed description of format VERSION."""
    fresh = describe_format(_ckpt(resumed[name], FIXTURE_STEP + 1))
    committed = _format_file()["fixtures"][name]
    assert fresh == committed, (
        f"{name}: the checkpoint this code writes differs from format {VERSION} as "
        f"recorded in format-v{VERSION}.json (files, fsdpkit.json keys or state-dict "
        "keys/dtypes/shapes changed). If that is intended, bump "
        "fsdpkit.checkpoint.stepdir.VERSION and follow docs/compatibility.md"
    )


@pytest.mark.parametrize("name", list(FIXTURES))
def test_fixture_exports_the_recorded_tensors(name: str) -> None:
    ckpt = _ckpt(FIXTURE_DIR / name)
    assert export_digest(ckpt, name=name) == EXPECTED[name]["tensors"]
    assert describe_format(ckpt) == _format_file()["fixtures"][name]


def test_fixtures_record_their_writer(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for name in FIXTURES:
        meta = read_meta(_ckpt(FIXTURE_DIR / name))
        assert meta["version"] == VERSION
        assert meta["fsdpkit_version"] == "0.1.0" and meta["torch_version"].startswith("2.")
    assert main(["ckpt", "inspect", str(_ckpt(FIXTURE_DIR / "tiny"))]) == 0
    torch_version = read_meta(_ckpt(FIXTURE_DIR / "tiny"))["torch_version"]
    assert (
        f"written by   fsdpkit 0.1.0 (torch {torch_version}), format 1" in capsys.readouterr().out
    )
    # a development build's checkpoint (before the versions were recorded) still inspects
    old = tmp_path / "tiny"
    shutil.copytree(FIXTURE_DIR / "tiny", old)
    marker = _ckpt(old) / "fsdpkit.json"
    meta = json.loads(marker.read_text())
    del meta["fsdpkit_version"], meta["torch_version"]
    marker.write_text(json.dumps(meta))
    assert main(["ckpt", "inspect", str(_ckpt(old))]) == 0
    assert "an fsdpkit older than 0.1.0 (no version recorded)" in capsys.readouterr().out


def test_unknown_format_version_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = tmp_path / "tiny"
    shutil.copytree(FIXTURE_DIR / "tiny", run)
    marker = _ckpt(run) / "fsdpkit.json"
    meta = json.loads(marker.read_text())
    marker.write_text(json.dumps({**meta, "version": VERSION + 1, "fsdpkit_version": "9.0.0"}))
    with pytest.raises(CheckpointError, match=rf"format version {VERSION + 1}.*fsdpkit 9\.0\.0"):
        read_meta(_ckpt(run))
    assert main(["ckpt", "inspect", str(_ckpt(run))]) == 2  # the CLI's user-error exit
    err = capsys.readouterr().err
    assert f"reads format {VERSION} only" in err and "compatibility.md" in err, err
