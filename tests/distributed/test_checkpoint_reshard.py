"""Load anywhere: a checkpoint saved at 2 ranks (full shard) loads at 1, 3 and 4 (hybrid
2x2) ranks; HF export loads in transformers; HF safetensors load into a sharded model.

One spawn per world size; each spawn runs every check for its size.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdpkit import build_mesh, shard
from fsdpkit.checkpoint import Checkpointer, ModelOptimizerState, load_hf_weights
from fsdpkit.config import CheckpointConfig, ParallelConfig, ParallelDims, RunConfig, mesh_shape
from fsdpkit.export import export
from fsdpkit.testing import run_ranks
from support import SEQ, TINY, build, full_state, lm_loss, untied

pytestmark = pytest.mark.distributed

CFG = untied()
GLOBAL = 12  # divisible by 1, 2, 3 and 4 ranks
STRATEGY = {1: "full", 2: "full", 3: "full", 4: "hybrid"}


def _batch(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(50 + i)
    return torch.randint(0, CFG.vocab_size, (GLOBAL, SEQ + 1), generator=g)


def _probe() -> torch.Tensor:
    return torch.arange(SEQ).remainder(CFG.vocab_size).unsqueeze(0)


def _model(
    world: int, *, seed: int, tied: bool = False
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    cfg = RunConfig(
        parallel=ParallelConfig(strategy=STRATEGY[world], shard_degree=2)
        if world == 4
        else ParallelConfig()
    )
    replicate, degree = mesh_shape(cfg, world_size=world, local_world_size=world)
    model = build(TINY if tied else CFG, seed=seed)
    shard(
        model,
        cfg,
        mesh=build_mesh(ParallelDims(replicate=replicate, shard=degree), device_type="cpu"),
    )
    return model, torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)


def _step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, i: int, rank: int, world: int
) -> None:
    per = GLOBAL // world
    lm_loss(model, _batch(i)[rank * per : (rank + 1) * per]).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(_probe()).detach().clone()


def save_at_two(rank: int, world: int, tmp: str) -> dict[str, Any]:
    model, opt = _model(world, seed=0)
    for i in range(3):
        _step(model, opt, i, rank, world)
    meta = {"world_size": world, "mesh": [1, world], "strategy": "full", "model": CFG.to_dict()}
    saver = Checkpointer(run_dir=Path(tmp) / "run", cfg=CheckpointConfig(), run_meta=meta)
    saver.save(3, {"app": ModelOptimizerState(model, opt)})
    out = {"logits": _logits(model), "saved": full_state(model)}
    _step(model, opt, 3, rank, world)
    out["continued"] = full_state(model)
    tied, tied_opt = _model(world, seed=0, tied=True)  # head shares the embedding
    _step(tied, tied_opt, 0, rank, world)
    meta["model"] = TINY.to_dict()
    saver = Checkpointer(run_dir=Path(tmp) / "tied", cfg=CheckpointConfig(), run_meta=meta)
    saver.save(1, {"app": ModelOptimizerState(tied, tied_opt)})
    out["tied_logits"] = _logits(tied)
    return out


def load_elsewhere(rank: int, world: int, tmp: str) -> dict[str, Any]:
    model, opt = _model(world, seed=9)
    cfg = CheckpointConfig(resume=str(Path(tmp) / "run" / "checkpoints" / "step-00000003"))
    loader = Checkpointer(run_dir=Path(tmp) / "other", cfg=cfg, run_meta={})
    out: dict[str, Any] = {"step": loader.resume({"app": ModelOptimizerState(model, opt)})}
    out["logits"] = _logits(model)
    _step(model, opt, 3, rank, world)
    out["continued"] = full_state(model)
    for name in ("hf", "hf16", "hf_tied"):
        fresh, _ = _model(world, seed=11, tied=name == "hf_tied")
        load_hf_weights(fresh, Path(tmp) / name)
        out[f"{name}_logits"], out[f"{name}_params"] = _logits(fresh), full_state(fresh)
    tied, tied_opt = _model(world, seed=12, tied=True)
    cfg = CheckpointConfig(resume=str(Path(tmp) / "tied" / "checkpoints" / "step-00000001"))
    loader = Checkpointer(run_dir=Path(tmp) / "other", cfg=cfg, run_meta={})
    loader.resume({"app": ModelOptimizerState(tied, tied_opt)})
    out["tied_logits"] = _logits(tied)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    tmp = tmp_path_factory.mktemp("reshard")
    out: dict[Any, Any] = {"tmp": tmp, 2: run_ranks(save_at_two, world_size=2, args=(str(tmp),))}
    ckpt = tmp / "run" / "checkpoints" / "step-00000003"
    export(ckpt, tmp / "hf", fmt="hf", max_shard_bytes=200_000)  # several shards
    export(ckpt, tmp / "hf16", fmt="hf", dtype="bf16")
    export(tmp / "tied" / "checkpoints" / "step-00000001", tmp / "hf_tied", fmt="hf")
    for world in (1, 3, 4):
        out[world] = run_ranks(load_elsewhere, world_size=world, args=(str(tmp),), timeout_s=240)
    return out


@pytest.mark.parametrize("world", [1, 3, 4])
def test_loads_at_other_world_sizes(runs: dict[Any, Any], world: int) -> None:
    saved = runs[2][0]
    for r in runs[world]:
        assert r["step"] == 3
        assert torch.equal(r["logits"], saved["logits"]), f"logits differ at world {world}"
        for key, ref in saved["continued"].items():
            torch.testing.assert_close(r["continued"][key], ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("world", [1, 3, 4])
def test_load_hf_weights_into_sharded_model(runs: dict[Any, Any], world: int) -> None:
    saved = runs[2][0]
    for r in runs[world]:
        torch.testing.assert_close(r["hf_logits"], saved["logits"], rtol=1e-6, atol=1e-6)
        assert torch.equal(r["hf_tied_logits"], saved["tied_logits"])
        assert torch.equal(r["tied_logits"], saved["tied_logits"])  # tied head restored
        for key, ref in saved["saved"].items():
            assert torch.equal(r["hf_params"][key], ref), key
            assert torch.equal(r["hf16_params"][key], ref.bfloat16().float()), key


def test_hf_export_loads_in_transformers(runs: dict[Any, Any]) -> None:
    transformers = pytest.importorskip("transformers")
    out = runs["tmp"] / "hf"
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    hf = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(_probe()).logits
    torch.testing.assert_close(logits, runs[2][0]["logits"], rtol=1e-5, atol=1e-5)
    assert dataclasses.asdict(CFG)["tie_embeddings"] is False
    assert "lm_head.weight" in {n for n, _ in hf.named_parameters()}
