"""``fsdpkit --version`` and ``fsdpkit version --json`` as a user runs them, and the one
source of the version (fsdpkit.version.__version__, which pyproject.toml reads)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import torch
from clirun import fsdpkit

import fsdpkit as package
from fsdpkit.cli import main
from fsdpkit.version import __version__, version_info

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def test_version_flag_prints_the_package_version(tmp_path: Path) -> None:
    result = fsdpkit("--version", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"fsdpkit {__version__}"


def test_version_json_names_torch_and_the_optional_libraries(
    capsys: pytest.CaptureFixture,
) -> None:
    assert main(["version", "--json"]) == 0  # in-process: the entry point is checked above
    info = json.loads(capsys.readouterr().out)
    assert info["fsdpkit"] == __version__ and info["torch"] == torch.__version__
    assert info["cuda"] == torch.version.cuda  # None on a CPU build
    assert set(info) == set(version_info()) >= {"transformers", "peft", "nccl"}


def test_one_source_of_the_version() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "fsdpkit.version.__version__"
    assert package.__version__ == __version__
