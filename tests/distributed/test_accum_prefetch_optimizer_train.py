"""Accumulation modes, AdamW kernels and explicit prefetch (levers of issue 12), on vs off.

fp32, 2 gloo ranks, 10 steps of the trainer's own ``train_step`` on the same data:
``parallel.accum_sync = every`` against ``last`` at 2 and 4 micro-batches (and with
``accum_keep_unsharded``), the three AdamW kernels against each other (and foreach
against for-loop under fp16's grad scaler), explicit forward / backward prefetch against FSDP2's
implicit one. Losses and final parameters
agree within 1e-5 relative; the reduce-scatters of each micro-batch are counted as
tests/distributed/test_accumulation.py counts them. One 4-rank HSDP run checks that
``every`` reduce-scatters each micro-batch but all-reduces across replicas once.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from fsdpkit import build_mesh, make_grad_scaler, resolve_precision, shard
from fsdpkit.config import ParallelDims, RunConfig, load, mesh_shape
from fsdpkit.loss.contract import next_token_loss
from fsdpkit.sharding.policy import sync_mode
from fsdpkit.testing import run_ranks
from fsdpkit.trainable.optim import impl_kwargs, resolve_impl
from fsdpkit.trainable.step import train_step
from support import TINY, build, count_collectives, full_state, global_batches, local

pytestmark = pytest.mark.distributed

STEPS = 10

# name -> (micro-batches per step, config overrides)
VARIANTS: dict[str, tuple[int, list[str]]] = {
    "last-2": (2, ["parallel.accum_sync=last"]),
    "every-2": (2, ["parallel.accum_sync=every"]),
    "last-4": (4, ["parallel.accum_sync=last"]),
    "every-4": (4, ["parallel.accum_sync=every"]),
    "every-4-keep": (4, ["parallel.accum_sync=every", "parallel.accum_keep_unsharded=true"]),
    "for-loop": (1, ["train.optimizer_impl=for-loop"]),
    "foreach": (1, ["train.optimizer_impl=foreach"]),
    "fused": (1, ["train.optimizer_impl=fused"]),
    "fp16-foreach": (1, ["precision.mode=fp16", "train.optimizer_impl=foreach"]),
    "fp16-for-loop": (1, ["precision.mode=fp16", "train.optimizer_impl=for-loop"]),
    "prefetch-off": (1, []),
    "prefetch-on": (1, ["parallel.forward_prefetch=2", "parallel.backward_prefetch=2"]),
}


def _train(rank: int, world: int, cfg: RunConfig, micro: int) -> dict[str, Any]:
    """The trainer's step over ``STEPS`` steps; per-micro-batch collective counts of
    the first step."""
    replicate, shard_deg = mesh_shape(cfg, world_size=world, local_world_size=2)
    mesh = build_mesh(ParallelDims(replicate=replicate, shard=shard_deg), device_type="cpu")
    model = build(TINY)
    shard(model, cfg, mesh=mesh)
    precision = resolve_precision(cfg.precision, device_type="cpu")
    impl = resolve_impl(cfg.train.optimizer_impl, device_type="cpu", grad_scaler=precision.scaler)
    # eps=1e-6: see tests/support.py (Adam amplifies rounding noise with 1e-8)
    opt = torch.optim.AdamW(
        model.parameters(), lr=2e-3, weight_decay=0.1, eps=1e-6, **impl_kwargs(impl)
    )
    scaler = make_grad_scaler(precision)
    counter: Counter[str] = Counter()
    per_micro: list[dict[str, int]] = []
    marks = [Counter(counter)]

    def mark(phase: str) -> None:
        if phase == "backward" and len(per_micro) < micro:
            per_micro.append(dict(counter - marks[-1]))
            marks.append(Counter(counter))

    count_collectives(counter)
    losses = []
    for step in global_batches(STEPS, micro=micro):
        batches = [local(step[i], rank, world // replicate * replicate) for i in range(micro)]
        result = train_step(
            model,
            opt,
            batches,
            loss_fn=next_token_loss,
            max_norm=1.0,
            keep_unsharded=cfg.parallel.accum_keep_unsharded,
            accum_sync=sync_mode(cfg.parallel.accum_sync),
            scaler=scaler,
            mark=mark,
        )
        losses.append(float(result.loss))
    out = {"loss": losses, "params": full_state(model), "per_micro": per_micro}
    return out | {"impl": impl, "opt_defaults": {k: opt.defaults[k] for k in ("foreach", "fused")}}


def _variants(rank: int, world: int) -> dict[str, Any]:
    return {
        name: _train(rank, world, load(None, overrides), micro)
        for name, (micro, overrides) in VARIANTS.items()
    }


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    return run_ranks(_variants, world_size=2, timeout_s=600)[0]  # type: ignore[no-any-return]


def _assert_same(a: dict[str, Any], b: dict[str, Any], *, tensorwise: bool = False) -> None:
    """Losses within 1e-5 relative; parameters elementwise (1e-5 relative, 1e-7
    absolute for elements near 0), or ``tensorwise``: the norm of the difference
    within 1e-5 of the tensor's norm. Adam turns rounding-level gradient differences
    (another summation order) into updates of up to lr on single near-zero elements;
    with 4 ranks of one sequence each (HSDP below) such elements reach ~1e-6."""
    torch.testing.assert_close(a["loss"], b["loss"], rtol=1e-5, atol=0)
    for key, value in a["params"].items():
        if tensorwise:
            diff = torch.linalg.vector_norm(b["params"][key] - value)
            assert diff <= 1e-5 * torch.linalg.vector_norm(value), (key, float(diff))
        else:
            torch.testing.assert_close(b["params"][key], value, rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.parametrize(
    ("off", "on"),
    [
        ("last-2", "every-2"),
        ("last-4", "every-4"),
        ("last-4", "every-4-keep"),
        ("foreach", "for-loop"),
        ("foreach", "fused"),
        # under the grad scaler (fused is refused there: [Note: AdamW kernels])
        ("fp16-foreach", "fp16-for-loop"),
        ("prefetch-off", "prefetch-on"),
    ],
)
def test_lever_on_equals_off(runs: dict[str, Any], off: str, on: str) -> None:
    _assert_same(runs[off], runs[on])


def test_kernel_variants_step_with_the_kernel_they_name(runs: dict[str, Any]) -> None:
    """The kernel comparisons above compare different kernels (the fp16 pair once
    compared foreach with auto, which is foreach under the scaler)."""
    switches = {
        "fused": {"foreach": None, "fused": True},
        "foreach": {"foreach": True, "fused": None},
        "for-loop": {"foreach": False, "fused": None},
    }  # torch.optim.AdamW's defaults as each kernel leaves them
    for name in ("for-loop", "foreach", "fused", "fp16-foreach", "fp16-for-loop"):
        impl = name.removeprefix("fp16-")
        assert runs[name]["impl"] == impl, name
        assert runs[name]["opt_defaults"] == switches[impl], (name, runs[name]["opt_defaults"])


@pytest.mark.parametrize("micro", [2, 4])
def test_every_reduce_scatters_each_micro_batch(runs: dict[str, Any], micro: int) -> None:
    units = TINY.n_layers + 1
    last, every = runs[f"last-{micro}"]["per_micro"], runs[f"every-{micro}"]["per_micro"]
    assert len(last) == len(every) == micro
    assert [c.get("reduce_scatter_single", 0) for c in last] == [0] * (micro - 1) + [units]
    assert [c.get("reduce_scatter_single", 0) for c in every] == [units] * micro


def test_keep_unsharded_still_saves_all_gathers_with_every(runs: dict[str, Any]) -> None:
    def gathers(name: str) -> int:
        return sum(c.get("all_gather_single", 0) for c in runs[name]["per_micro"])

    assert gathers("every-4-keep") < gathers("every-4")


def _hybrid(rank: int, world: int) -> dict[str, Any]:
    base = ["parallel.strategy=hybrid", "parallel.shard_degree=2"]
    return {
        mode: _train(rank, world, load(None, [*base, f"parallel.accum_sync={mode}"]), 2)
        for mode in ("last", "every")
    }


@pytest.mark.slow
def test_hybrid_every_all_reduces_once_and_matches_last() -> None:
    got = run_ranks(_hybrid, world_size=4, timeout_s=600)[0]
    _assert_same(got["last"], got["every"], tensorwise=True)
    units = TINY.n_layers + 1
    every = got["every"]["per_micro"]
    assert [c.get("reduce_scatter_single", 0) for c in every] == [units, units]
    assert [c.get("all_reduce", 0) for c in every] == [0, units]
