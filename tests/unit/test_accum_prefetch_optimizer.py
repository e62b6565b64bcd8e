"""Accumulation modes (``parallel.accum_sync``), explicit prefetch and the AdamW kernel
without a process group: the config keys, the kernel choice, and how the planner models
each mode, each prefetch depth and each kernel's temporary (the runtime side:
tests/distributed/test_accum_prefetch_optimizer_train.py)."""

from __future__ import annotations

import pytest

from fsdpkit.config import load
from fsdpkit.errors import ConfigError
from fsdpkit.planner import parse_device, plan
from fsdpkit.planner.api import decide_accum_sync
from fsdpkit.planner.search.auto import accum_sync_choice
from fsdpkit.planner.search.recommend import recommend
from fsdpkit.planner.shapes.scenario import scenario
from fsdpkit.run.resolve import resolve
from fsdpkit.sharding.policy import sync_mode
from fsdpkit.trainable.optim import impl_kwargs, resolve_impl

GiB = 2**30
LLAMA_1B = [
    "model.preset=llama3-1b", "data.seq_len=2048", "train.micro_batch_size=1",
    "train.grad_accum=4", "activations.mode=full",
    "train.chunked_loss=off",  # the peak at the loss backward, where last holds every grad
]  # fmt: skip
# units of ~21 MB (bf16) and tiny activations: prefetched units show in the peaks
WIDE = [
    "model.preset=tiny", "model.n_layers=8", "model.dim=1024", "model.ffn_dim=2048",
    "model.n_heads=8", "model.n_kv_heads=8", "data.seq_len=32", "train.micro_batch_size=1",
    "activations.mode=full", "precision.mode=bf16",
]  # fmt: skip


def _plan(overrides: list[str], *, world: int = 8, device: str = "h100") -> object:
    return plan(load(None, overrides), world_size=world, device=parse_device(device))


def test_config_keys_and_their_checks() -> None:
    cfg = load(None, [])
    assert cfg.parallel.accum_sync == "auto" and cfg.train.optimizer_impl == "auto"
    assert (cfg.parallel.forward_prefetch, cfg.parallel.backward_prefetch) == (0, 1)
    with pytest.raises(ConfigError, match=r"parallel\.backward_prefetch"):
        load(None, ["parallel.backward_prefetch=0"])
    with pytest.raises(ConfigError, match=r"parallel\.forward_prefetch"):
        load(None, ["parallel.forward_prefetch=-1"])
    with pytest.raises(ConfigError, match="accum_sync"):
        load(None, ["parallel.accum_sync=sometimes"])


def test_runtime_reads_unresolved_auto_as_last() -> None:
    assert [sync_mode(v) for v in ("auto", "last", "every")] == ["last", "last", "every"]


def test_optimizer_kernel_choice() -> None:
    assert resolve_impl("auto", device_type="cpu") == "fused"
    assert resolve_impl("auto", device_type="cuda") == "fused"
    assert resolve_impl("auto", device_type="mps") == "foreach"
    assert resolve_impl("fused", device_type="xpu") == "foreach"  # no fused kernel there
    assert resolve_impl("for-loop", device_type="cpu") == "for-loop"
    assert resolve_impl("auto", device_type="cpu", grad_scaler=True) == "foreach"
    with pytest.raises(ConfigError, match="gradient scaler"):
        load(None, ["precision.mode=fp16", "train.optimizer_impl=fused"])
    load(None, ["precision.mode=fp16", "precision.grad_scaler=true", "train.optimizer_impl=auto"])
    assert impl_kwargs("fused") == {"fused": True}
    assert impl_kwargs("foreach") == {"foreach": True}
    assert impl_kwargs("for-loop") == {"foreach": False}


def test_every_trades_unsharded_grads_for_reduce_scatters() -> None:
    last = _plan([*LLAMA_1B, "parallel.accum_sync=last"])
    every = _plan([*LLAMA_1B, "parallel.accum_sync=every"])
    # at the peak (the last micro-batch's loss backward) last holds every parameter's
    # unsharded grad (bf16 preset: fp32 reduce); every holds the sharded grads instead
    units = list(last.scenario.all_units)
    held = 4 * sum(u.grads_numel for u in units)
    sharded = 4 * sum(u.grads_sharded for u in units)
    assert last.memory.peak.bytes - every.memory.peak.bytes == held - sharded
    assert (
        last.memory.peak.breakdown["unsharded_grads"]
        > every.memory.peak.breakdown["unsharded_grads"]
    )
    assert every.comm.reduce_scatter == 4 * last.comm.reduce_scatter
    units = len(last.scenario.units) + 1
    assert every.comm.calls - last.comm.calls == 3 * units
    assert every.comm.all_gather == last.comm.all_gather


def test_hybrid_every_all_reduces_once() -> None:
    hsdp = [*LLAMA_1B, "parallel.strategy=hybrid", "parallel.shard_degree=4"]
    last = _plan([*hsdp, "parallel.accum_sync=last"])
    every = _plan([*hsdp, "parallel.accum_sync=every"])
    assert every.comm.all_reduce == last.comm.all_reduce > 0
    assert every.comm.reduce_scatter == 4 * last.comm.reduce_scatter
    assert every.memory.peak.bytes < last.memory.peak.bytes


def test_auto_is_last_when_it_fits_else_every() -> None:
    cfg = load(None, LLAMA_1B)
    sc = scenario(cfg, world_size=8, device=parse_device("h100"))
    assert sc.accum_auto
    assert decide_accum_sync(sc, usable=None).accum_sync == "last"  # no budget
    roomy = decide_accum_sync(sc, usable=100 * GiB)
    tight = decide_accum_sync(sc, usable=8 * GiB)
    assert (roomy.accum_sync, tight.accum_sync) == ("last", "every")
    assert any("accum_sync = auto planned as every" in n for n in tight.notes)
    assert _plan(LLAMA_1B, device="8GiB").scenario.accum_sync == "every"
    assert _plan(LLAMA_1B, device="h100").scenario.accum_sync == "last"


def test_a_run_decides_auto_with_its_budget() -> None:
    sizes = {"world_size": 8, "local_world_size": 8}
    assert accum_sync_choice(load(None, LLAMA_1B), **sizes) == "last"  # no budget given
    small = load(None, [*LLAMA_1B, "parallel.device_mem=8GiB"])
    assert accum_sync_choice(small, **sizes) == "every"
    resolved = resolve(None, [*LLAMA_1B, "parallel.device_mem=8GiB"], **sizes).config
    assert resolved.parallel.accum_sync == "every"  # written out for config.toml
    assert resolve(None, LLAMA_1B, **sizes).config.parallel.accum_sync == "last"
    factory = load(None, ["model.factory=pkg.mod:fn", "parallel.device_mem=8GiB"])
    assert accum_sync_choice(factory, **sizes) == "last"  # not plannable: the default


def test_recommender_searches_both_modes() -> None:
    cfg = load(None, [*LLAMA_1B, "activations.mode=none"])
    rec = recommend(cfg, world_size=8, device=parse_device("24GiB"))
    modes = {c.config.parallel.accum_sync for c in rec.ranked}
    assert rec.best is not None
    everies = [c for c in rec.ranked if c.config.parallel.accum_sync == "every"]
    assert all(c.plan.scenario.grad_accum > 1 for c in everies)
    assert modes <= {"last", "every", "auto"}
    # where both fit, last (less traffic) is never ranked behind the same config with every
    for c in everies:
        twin = {**c.changes}
        twin.pop("parallel.accum_sync")
        for other in rec.ranked:
            if other.changes == twin:
                assert other.cost.total_s <= c.cost.total_s


def test_prefetch_holds_units_in_flight() -> None:
    off = _plan(WIDE).memory.phase_peaks
    unit = _plan(WIDE).scenario.units[0].gathered * 2  # bf16 all-gather output
    fwd = [_plan([*WIDE, f"parallel.forward_prefetch={k}"]).memory.phase_peaks for k in (1, 2)]
    bwd = [_plan([*WIDE, f"parallel.backward_prefetch={k}"]).memory.phase_peaks for k in (2, 3)]
    assert off["forward"] < fwd[0]["forward"] < fwd[1]["forward"] <= off["forward"] + 2 * unit
    assert off["backward"] < bwd[0]["backward"] < bwd[1]["backward"]
    assert bwd[1]["backward"] <= off["backward"] + 2 * unit
    assert fwd[1]["backward"] == off["backward"]  # forward prefetch ends with forward


def test_each_adamw_kernel_temporary() -> None:
    small = ["model.vocab_size=2048", "data.seq_len=128", "precision.mode=fp32",
             "activations.mode=full"]  # fmt: skip
    peaks = {
        impl: _plan([*small, f"train.optimizer_impl={impl}"], world=2, device="cpu:8GiB")
        for impl in ("fused", "foreach", "for-loop")
    }
    sc = peaks["fused"].scenario
    units = list(sc.all_units)
    opt = {k: p.memory.phase_peaks["optimizer step"] for k, p in peaks.items()}
    assert opt["foreach"] - opt["fused"] == 4 * sum(u.grads_matrix_sharded for u in units)
    assert opt["for-loop"] - opt["fused"] == 8 * max(u.largest_sharded for u in units)


ACCUMULATED_ROWS = ("S full accum=2", "ACC S accum=4 last", "ACC A accum=2", "MP A dp2 x tp2 +AC")
"""bench/plan_accuracy.py's rows whose peak sits in a later micro-batch's backward while
``last`` holds the accumulated grads (the "MP" one is also pinned by
tests/unit/test_planner_tp.py)."""


def test_later_micro_batches_sum_their_grads_in_place() -> None:
    # [Note: accumulating in place]: the analytic plan against the committed measured
    # peaks (rerun: python bench/plan_accuracy.py --only "ACC A" --merge). Counting a
    # unit's fresh grads beside its accumulated ones read +0.38% to +1.0% here.
    import json
    import sys
    from pathlib import Path

    bench = Path(__file__).parents[2] / "bench"
    sys.path.insert(0, str(bench))
    from plan_accuracy_cases import CASES  # bench/ is not a package

    rows = json.loads((bench / "results" / "plan_accuracy.json").read_text())["rows"]
    peaks = {(r["configuration"], r["world"]): r["typical"] for r in rows}
    cases = [c for c in CASES if c.name.startswith(ACCUMULATED_ROWS) and "accum" in c.name]
    assert len(cases) == 5
    for c in cases:
        truth = peaks[(c.name, c.world)]
        planned = plan(c.config(), world_size=c.world, trace=False).memory.peak.bytes
        assert abs(planned - truth) / truth <= 0.001, (c.name, planned, truth)


def test_later_micro_batches_trace_the_tied_heads_grad_beside_the_accumulated_one() -> None:
    # [Note: the head's gradient under fake tensors] in fsdpkit.loss.chunked_ce: the
    # traced plan against the committed measured peaks (rerun: python
    # bench/plan_accuracy.py --only "ACC A accum=2" --merge, and "ACC M accum=3 last"
    # --exact). Adding the tied head's gradient into the accumulated .grad at once read
    # -3.2% / -2.2% / -0.76% here.
    import json
    import sys
    from pathlib import Path

    bench = Path(__file__).parents[2] / "bench"
    sys.path.insert(0, str(bench))
    from plan_accuracy_cases import CASES  # bench/ is not a package

    rows = json.loads((bench / "results" / "plan_accuracy.json").read_text())["rows"]
    peaks = {(r["configuration"], r["world"]): r["typical"] for r in rows}
    cases = [c for c in CASES if c.name.startswith(("ACC A accum=2", "ACC M accum=3 last"))]
    assert len(cases) == 3  # +AC (world 4), selective, no checkpointing (world 2)
    for c in cases:
        truth = peaks[(c.name, c.world)]
        traced = plan(c.config(), world_size=c.world, trace=True).memory.peak.bytes
        assert abs(traced - truth) / truth <= 0.003, (c.name, traced, truth)
