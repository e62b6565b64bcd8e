"""Verification stays complete when a load reshards ([Note: verified single-pass load]):
a checkpoint saved at 2 ranks, damaged where no rank at the new world size loads from
(or where another rank loads from), is refused at 1 and 3 ranks naming the file, before
any loaded state is applied; ``resume=auto`` falls back to the previous checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdpkit import build_mesh, shard
from fsdpkit.checkpoint import Checkpointer, CheckpointError, ModelOptimizerState
from fsdpkit.config import CheckpointConfig, RunConfig
from fsdpkit.testing import run_ranks
from support import TINY, LoadProbe, build, full_state

pytestmark = pytest.mark.distributed


def _state(world: int, seed: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    model = build(TINY, seed=seed)
    if world > 1:
        shard(model, RunConfig(), mesh=build_mesh(device_type="cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, {"app": ModelOptimizerState(model, opt), "probe": LoadProbe()}


def save_at_two(rank: int, world: int, tmp: str) -> dict[str, Any]:
    model, state = _state(world, seed=0)
    saver = Checkpointer(run_dir=Path(tmp) / "run", cfg=CheckpointConfig(keep=5), run_meta={})
    saver.save(3, state)
    return full_state(model)


def _resume(run: Path, resume: str, world: int) -> tuple[Any, int, dict[str, torch.Tensor]]:
    model, state = _state(world, seed=7)
    try:
        got: Any = Checkpointer(
            run_dir=run, cfg=CheckpointConfig(resume=resume), run_meta={}
        ).resume(state)
    except CheckpointError as exc:
        got = str(exc)
    return got, state["probe"].loaded, full_state(model)


def load_damaged(rank: int, world: int, tmp: str) -> dict[str, Any]:
    base = Path(tmp)
    out = {}
    for name in ("mid", "end"):
        ckpt = base / name / "checkpoints" / "step-00000003"
        out[name] = _resume(base / name, str(ckpt), world)[:2]
    out["auto"] = _resume(base / "fallback", "auto", world)
    return out


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    tmp = tmp_path_factory.mktemp("verify")
    saved = run_ranks(save_at_two, world_size=2, args=(str(tmp),))[0]
    good = tmp / "run" / "checkpoints" / "step-00000003"
    for name, file, where in (("mid", "__0_0.distcp", 0.5), ("end", "__1_0.distcp", -30)):
        copy = tmp / name / "checkpoints" / good.name
        shutil.copytree(good, copy)
        size = (copy / file).stat().st_size
        _flip(copy / file, int(size * where) if where > 0 else size + int(where))
    shutil.copytree(good, tmp / "fallback" / "checkpoints" / good.name)
    shutil.copytree(
        tmp / "mid" / "checkpoints" / good.name, tmp / "fallback" / "checkpoints" / "step-00000004"
    )
    out: dict[Any, Any] = {"saved": saved, 1: [load_damaged(0, 1, str(tmp))]}
    out[3] = run_ranks(load_damaged, world_size=3, args=(str(tmp),), timeout_s=240)
    return out


@pytest.mark.parametrize("world", [1, 3])
def test_damage_is_found_at_any_world_size(runs: dict[Any, Any], world: int) -> None:
    for r in runs[world]:
        for name, file in (("mid", "__0_0.distcp"), ("end", "__1_0.distcp")):
            message, applied = r[name]
            assert isinstance(message, str) and f"{file} is corrupt" in message, message
            assert applied == 0  # failed before load_state_dict ran
        step, applied, params = r["auto"]
        assert step == 3 and applied == 1
        for key, ref in runs["saved"].items():
            assert torch.equal(params[key], ref), key
