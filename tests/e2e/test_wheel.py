"""The release as a user installs it: ``python -m build`` makes the sdist and the wheel
(the wheel from the sdist, so the sdist is complete), the wheel with the ``hf`` and
``lora`` extras goes into a fresh virtual environment (no system site-packages, no
PYTHONPATH), and the installed ``fsdpkit`` trains, plans, inspects a checkpoint and runs
the README's Hugging Face quick start from the sdist's examples/, in a directory outside
the source tree.

torch is pinned to the version running the tests, so pip takes it from its cache (or
the find-links of this machine) instead of resolving a new one. ~2-3 min: slow.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

from fsdpkit.version import __version__

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
WHEEL = f"fsdpkit-{__version__}-py3-none-any.whl"
SDIST = f"fsdpkit-{__version__}.tar.gz"


def _env(venv: Path) -> dict[str, str]:
    """The environment of a user's shell with the venv first on PATH: none of the test
    run's PYTHONPATH (which points at the source tree) or launcher variables."""
    drop = {"PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    return env


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{' '.join(cmd)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    )
    return result.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("wheel")
    dist, venv, user = tmp / "dist", tmp / "venv", tmp / "user"
    user.mkdir()
    env = _env(venv)
    # Built from a copy: setuptools writes build/ and *.egg-info into the tree it builds.
    source = tmp / "source"
    skip = (".git", ".venv", "runs", "build", "dist", "*.egg-info", "__pycache__", ".*_cache")
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*skip))
    _run([sys.executable, "-m", "build", "--outdir", str(dist), str(source)], cwd=tmp, env=env)
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp, env=env)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile"]
    _run([*pip, f"torch=={torch.__version__}", f"{dist / WHEEL}[hf,lora]"], cwd=tmp, env=env)
    with tarfile.open(dist / SDIST) as sdist:
        sdist.extractall(tmp / "sdist", filter="data")
    return {"dist": dist, "venv": venv, "user": user, "sdist": tmp / "sdist" / SDIST[:-7]}


def test_wheel_and_sdist_ship_what_users_need(installed: dict[str, Path]) -> None:
    with zipfile.ZipFile(installed["dist"] / WHEEL) as wheel:
        names = set(wheel.namelist())
        meta = wheel.read(f"fsdpkit-{__version__}.dist-info/METADATA").decode()
        entry = wheel.read(f"fsdpkit-{__version__}.dist-info/entry_points.txt").decode()
    assert (
        "fsdpkit/py.typed" in names and f"fsdpkit-{__version__}.dist-info/licenses/LICENSE" in names
    )
    assert f"Version: {__version__}" in meta and "License-Expression: Apache-2.0" in meta
    assert "fsdpkit = fsdpkit.cli:main" in entry
    # only what users call: run_ranks of fsdpkit.testing, none of the test-only helpers
    # (tests/netns.py, slurmcluster.py, slurmconf.py; examples/tiny_hf.py, once testing/hf)
    testing = sorted(n for n in names if n.startswith("fsdpkit/testing/"))
    assert testing == ["fsdpkit/testing/__init__.py", "fsdpkit/testing/spawn.py"], testing
    test_only = {"netns.py", "slurmcluster.py", "slurmconf.py", "tiny_hf.py"}
    assert not [n for n in names if Path(n).name in test_only], sorted(names)
    for path in (
        "LICENSE",
        "CHANGELOG.md",
        "examples/make_tiny_hf_model.py",
        "examples/tiny_hf.py",  # the quick start's script imports it from beside itself
        "docs/compatibility.md",
    ):
        assert (installed["sdist"] / path).is_file(), f"the sdist lacks {path}"


def test_installed_cli_trains_plans_and_inspects(installed: dict[str, Path]) -> None:
    venv, user = installed["venv"], installed["user"]
    env = _env(venv)
    where = _run(["python", "-c", "import fsdpkit; print(fsdpkit.__file__)"], cwd=user, env=env)
    assert where.startswith(str(venv)), where  # the installed copy, not the source tree
    assert _run(["fsdpkit", "--version"], cwd=user, env=env).strip() == f"fsdpkit {__version__}"
    plan = subprocess.Popen(  # independent of the run: at the same time
        ["fsdpkit", "plan"], cwd=user, env=env, stdout=subprocess.PIPE, text=True
    )
    _run(["fsdpkit", "train", "train.steps=2", "checkpoint.every=2"], cwd=user, env=env)
    planned, _ = plan.communicate(timeout=300)
    assert plan.returncode == 0 and "per rank" in planned, planned
    ckpt = user / "runs" / "default" / "checkpoints" / "step-00000002"
    inspect = _run(["fsdpkit", "ckpt", "inspect", str(ckpt)], cwd=user, env=env)
    assert f"written by   fsdpkit {__version__} (torch {torch.__version__})" in inspect, inspect


def test_readme_hf_quick_start_from_the_sdist(installed: dict[str, Path]) -> None:
    """README "Train a Hugging Face model", with 2 steps instead of 200."""
    venv, user = installed["venv"], installed["user"] / "hf"
    user.mkdir()
    env = _env(venv)
    example = installed["sdist"] / "examples" / "make_tiny_hf_model.py"
    _run(["python", str(example), "tiny-llama", "--arch", "llama"], cwd=user, env=env)
    train = ["train", "model.hf=tiny-llama", "train.steps=2", "checkpoint.every=2"]
    _run(["fsdpkit", *train], cwd=user, env=env)
    ckpt = "runs/default/checkpoints/step-00000002"
    _run(
        ["fsdpkit", "ckpt", "export", ckpt, "--format", "hf", "tiny-llama-trained"],
        cwd=user,
        env=env,
    )
    code = (
        "from transformers import AutoModelForCausalLM as M; "
        "print(M.from_pretrained('tiny-llama-trained').num_parameters())"
    )
    assert int(_run(["python", "-c", code], cwd=user, env=env).split()[-1]) > 0
