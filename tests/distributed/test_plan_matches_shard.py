"""The planner plans exactly the units ``shard()`` builds.

For every strategy x precision preset x activation-checkpointing mode (and
blocks_per_unit 1 and 3, an int reshard_after_forward, a large untied vocabulary,
whose embedding, final norm and head get units of their own), a real
model is sharded on gloo ranks by the trainer's own builder and ``shard()``; what
FSDP2 and the checkpoint wrapper then hold — units, their blocks, resharding after
forward, compute and reduce dtypes, checkpointed blocks and which of them run under
the selective policy — is read back from the
modules and compared with the planner's scenario of the same config.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch.distributed._composable import checkpoint
from torch.distributed.fsdp import FSDPModule

from fsdpkit import build_mesh, shard
from fsdpkit.config import ParallelDims, load, mesh_shape
from fsdpkit.models.factory import build_model
from fsdpkit.planner.shapes.scenario import model_shape, scenario
from fsdpkit.precision import PRESETS
from fsdpkit.sharding import choose_blocks
from fsdpkit.sharding.activations import checkpoint_mode
from fsdpkit.sharding.policy import effective_reshard
from fsdpkit.strategies import STRATEGIES
from fsdpkit.testing import run_ranks

pytestmark = pytest.mark.distributed

MODEL = [
    "model.dim=32", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
    "model.ffn_dim=64", "model.vocab_size=4096", "model.tie_embeddings=false", "data.seq_len=16",
]  # fmt: skip
"""Embedding and head hold ~80% of the parameters: the large-vocabulary case."""

EDGES = {"model.embed_tokens": "embedding", "model.norm": "norm", "lm_head": "head"}
"""The untied model's edge units ([Note: edge units] in fsdpkit.sharding.edges)."""

AC = (
    ["activations.mode=none"], ["activations.mode=full"], ["activations.mode=every"],
    ["activations.mode=selective"],
)  # fmt: skip


def _cases(world: int) -> list[list[str]]:
    out = []
    for strategy, precision, ac in itertools.product(STRATEGIES, PRESETS, AC):
        extra = ["parallel.shard_degree=2"] if STRATEGIES[strategy].hybrid else []
        out.append([f"parallel.strategy={strategy}", f"precision.mode={precision}", *ac, *extra])
    out.append(["parallel.blocks_per_unit=3", "activations.mode=every", "activations.every=3"])
    if world == 4:
        out.append(["parallel.reshard_after_forward=2", "activations.mode=full"])
    return out


def _applied_reshard(group: Any) -> bool | int:
    """What FSDP2 does after forward, read from the unit's parameter group."""
    post = group.post_forward_mesh_info
    if post is None:
        return False
    return True if post.shard_mesh_size == group.mesh_info.shard_mesh_size else post.shard_mesh_size


def _unit_facts(module: FSDPModule) -> dict[str, Any] | None:
    """None for a unit without parameters (a root whose modules all have units)."""
    group = module._get_fsdp_state()._fsdp_param_group
    if group is None:
        return None
    mp = group.mp_policy
    return {
        "modules": len(group.modules),
        "reshard": _applied_reshard(group),
        "param_dtype": mp.param_dtype or torch.float32,
        "reduce_dtype": mp.reduce_dtype or mp.param_dtype or torch.float32,
    }


def _applied(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    cfg = load(None, [*MODEL, *overrides])
    built = build_model(cfg.model, vocab_size=256, seq_len=cfg.data.seq_len, seed=0)
    blocks = list(choose_blocks(built.module).blocks)
    replicate, shard_deg = mesh_shape(cfg, world_size=world, local_world_size=world)
    shard(
        built.module,
        cfg,
        mesh=build_mesh(ParallelDims(replicate=replicate, shard=shard_deg), device_type="cpu"),
    )
    units = []
    seen: set[int] = set()
    for b in blocks:
        group = b._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
        if id(group) not in seen:
            seen.add(id(group))
            units.append(_unit_facts(b))  # type: ignore[arg-type]
    edges = {
        EDGES[name]: _unit_facts(module)
        for name, module in built.module.named_modules()
        if name in EDGES and isinstance(module, FSDPModule)
    }
    return {
        "block_class": type(blocks[0]).__name__.removeprefix("FSDP"),
        "units": units,
        "edges": edges,
        "root": _unit_facts(built.module),  # type: ignore[arg-type]
        "checkpointed": [
            checkpoint.state(b) is not None or checkpoint_mode(b) is not None for b in blocks
        ],
        "selective": [checkpoint_mode(b) == "selective" for b in blocks],
    }


def _applied_all(rank: int, world: int, cases: list[list[str]]) -> list[dict[str, Any]]:
    return [_applied(rank, world, case) for case in cases]


def _planned(world: int, overrides: list[str]) -> dict[str, Any]:
    cfg = load(None, [*MODEL, *overrides])
    sc = scenario(cfg, world_size=world, ranks_per_node=world, vocab_size=256)
    preset = PRESETS[sc.precision]
    assert model_shape(cfg, vocab_size=256).vocab_size == 4096

    def facts(u: Any, modules: int) -> dict[str, Any]:
        return {
            "modules": modules,
            "reshard": effective_reshard(u.reshard_after_forward, shard=sc.dims.fsdp_shard),
            "param_dtype": preset.param_dtype,
            "reduce_dtype": preset.reduce_dtype,
        }

    return {
        "block_class": sc.layout.block_class,
        "units": [facts(u, len(u.blocks)) for u in sc.units],
        "edges": {u.name: facts(u, 1) for u in sc.edges},
        "root": facts(sc.root, 1) if sc.root.numel else None,
        "checkpointed": [c for u in sc.units for c in u.checkpointed],
        "selective": [
            c and cfg.activations.mode == "selective" for u in sc.units for c in u.checkpointed
        ],
    }


@pytest.mark.parametrize("world", [2, 4])
def test_planned_units_are_the_applied_units(world: int) -> None:
    cases = _cases(world)
    applied = run_ranks(_applied_all, world_size=world, args=(cases,), timeout_s=300)[0]
    for case, real in zip(cases, applied):
        assert real["block_class"] == "DecoderLayer", case  # not nn.Linear
        assert list(real["edges"]) == ["embedding", "norm", "head"], case
        assert _planned(world, case) == real, case
