"""Checkpoints written by fsdpkit 0.1.0 (tests/fixtures/checkpoints, made by its
make_fixtures.py) still resume bit-exactly and export the same tensors, on every later
commit; a format this fsdpkit does not know is refused by name; and a change of what a
checkpoint holds without a new format version fails here ([Note: canonical format
description] in tests/compat_support.py). The policy: docs/compatibility.md.

The four resumes run at once (start-up is most of each: ~10 s of torch import + spawn).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from clirun import cli_env

from compat_support import (
    FIXTURE_STEP,
    FIXTURES,
    describe_format,
    export_digest,
    metrics_loss,
    train_command,
)
from fsdpkit.checkpoint import CheckpointError, read_meta
from fsdpkit.checkpoint.stepdir import VERSION
from fsdpkit.cli import main
from fsdpkit.version import __version__

pytestmark = pytest.mark.e2e

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


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """Every fixture copied to a scratch directory and resumed for one step."""
    work = tmp_path_factory.mktemp("compat")
    for name in (*SHARED, *FIXTURES):
        src = FIXTURE_DIR / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, work / name)
    procs = {
        name: subprocess.Popen(
            train_command(name, steps=FIXTURE_STEP + 1),
            cwd=work,
            env=cli_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in FIXTURES
    }
    out = {}
    for name, proc in procs.items():
        log, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name}: resume failed:\n{log[-3000:]}"
        out[name] = (work / name, log)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FIXTURES))
def test_fixture_resumes_bit_exactly(resumed: dict[str, tuple[Path, str]], name: str) -> None:
    run, log = resumed[name]
    assert f"resumed from step {FIXTURE_STEP}" in log, log[-3000:]
    got = metrics_loss(run / "metrics.jsonl", FIXTURE_STEP + 1)
    assert got == EXPECTED[name]["next_loss"], (
        f"{name}: step {FIXTURE_STEP + 1} after resuming the 0.1.0 checkpoint has loss "
        f"{got!r}, the uninterrupted 0.1.0 run had {EXPECTED[name]['next_loss']!r}"
    )
    history = (FIXTURE_DIR / name / "metrics.jsonl").read_text().splitlines()
    kept = sum(json.loads(line)["step"] <= FIXTURE_STEP for line in history)  # resume keeps
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[kept]["fsdpkit_version"] == __version__, records  # the resume's first


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FIXTURES))
def test_checkpoint_format_unchanged_or_version_bumped(
    resumed: dict[str, tuple[Path, str]], name: str
) -> None:
    """What this commit writes matches the committed description of format VERSION."""
    fresh = describe_format(_ckpt(resumed[name][0], FIXTURE_STEP + 1))
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
