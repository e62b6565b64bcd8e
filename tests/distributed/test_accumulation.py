"""Gradient accumulation: k micro-batches with sync only on the last equal one batch k
times larger, and the non-final micro-batches issue no gradient reduction at all."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from fsdpkit import build_mesh, gradient_sync, shard
from fsdpkit.config import ParallelConfig, ParallelDims, RunConfig, mesh_shape
from fsdpkit.testing import run_ranks
from support import (
    GLOBAL_BATCH,
    TINY,
    build,
    count_collectives,
    global_batches,
    lm_loss,
    local,
)

pytestmark = pytest.mark.distributed

K = 4


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}


def _accumulate(rank: int, world: int, strategy: str, keep_unsharded: bool) -> dict[str, Any]:
    cfg = RunConfig(parallel=ParallelConfig(strategy=strategy))  # type: ignore[arg-type]
    replicate, shard_deg = mesh_shape(cfg, world_size=world, local_world_size=2)
    mesh = build_mesh(ParallelDims(replicate=replicate, shard=shard_deg), device_type="cpu")
    micro = global_batches(1, micro=K)[0]  # (K, GLOBAL_BATCH, seq+1)
    counter: Counter[str] = Counter()
    count_collectives(counter)

    accumulated = build(TINY)
    shard(accumulated, cfg, mesh=mesh)
    per_micro = []
    for i in range(K):
        before = Counter(counter)
        with gradient_sync(accumulated, enabled=i == K - 1, keep_unsharded=keep_unsharded):
            (lm_loss(accumulated, local(micro[i], rank, world)) / K).backward()
        per_micro.append(dict(counter - before))

    big = build(TINY)
    shard(big, cfg, mesh=mesh)
    # One batch K times larger: this rank's rows of every micro-batch, together.
    tokens = torch.cat([local(micro[i], rank, world) for i in range(K)])
    lm_loss(big, tokens).backward()
    return {"per_micro": per_micro, "acc": _grads(accumulated), "big": _grads(big)}


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    out = {}
    for name, world, strategy, keep in [
        ("full", 2, "full", False),
        ("full-keep", 2, "full", True),
        ("hybrid", 4, "hybrid", False),
    ]:
        out[name] = run_ranks(_accumulate, world_size=world, args=(strategy, keep))[0]
    return out


@pytest.mark.parametrize("name", ["full", "full-keep", "hybrid"])
def test_accumulated_update_equals_one_big_batch(runs: dict[str, Any], name: str) -> None:
    got = runs[name]
    assert GLOBAL_BATCH % 2 == 0
    for key, big in got["big"].items():
        torch.testing.assert_close(got["acc"][key], big, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", ["full", "full-keep", "hybrid"])
def test_non_final_micro_batches_do_not_reduce(runs: dict[str, Any], name: str) -> None:
    per_micro = runs[name]["per_micro"]
    units = TINY.n_layers + 1
    for counts in per_micro[:-1]:
        assert counts.get("reduce_scatter_single", 0) == 0, counts
        assert counts.get("all_reduce", 0) == 0, counts
    assert per_micro[-1]["reduce_scatter_single"] == units
    if name == "hybrid":
        assert per_micro[-1]["all_reduce"] == units  # HSDP: across replicas too


def test_keeping_params_unsharded_saves_all_gathers(runs: dict[str, Any]) -> None:
    gathers = sum(c.get("all_gather_single", 0) for c in runs["full"]["per_micro"])
    kept = sum(c.get("all_gather_single", 0) for c in runs["full-keep"]["per_micro"])
    assert kept < gathers, (kept, gathers)
