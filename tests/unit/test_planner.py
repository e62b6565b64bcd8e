"""Planner arithmetic: ZeRO model states, devices, errors, speed, recommend, reports.

No process group and no tensors: the analytic planner replays FSDP2 over shapes.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from fsdpkit.config import ConfigError, load
from fsdpkit.planner import Device, DeviceError, PlanError, parse_device, parse_size, plan
from fsdpkit.planner.formatting import format_plan, format_recommendation, plan_dict, toml_lines
from fsdpkit.planner.replay.blockmem import Sizes, block_backward, block_forward, saved_per_block
from fsdpkit.planner.replay.gradlife import last_grad_bytes
from fsdpkit.planner.replay.walk import Step
from fsdpkit.planner.search.recommend import recommend
from fsdpkit.planner.shapes.scenario import scenario
from fsdpkit.planner.shapes.states import model_states
from support import PLAN_T

GiB = 1024**3
# Every dim divisible by the shard degrees used below: no FSDP2 padding.
EVEN = ["model.dim=256", "model.ffn_dim=512", "model.vocab_size=1024", "model.n_layers=4"]


def _cfg(*overrides: str):  # type: ignore[no-untyped-def]
    return load(None, [*EVEN, "precision.mode=fp32", *overrides])


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-pure", "fp16"])
@pytest.mark.parametrize(
    ("overrides", "world", "shard"),
    [
        ([], 1, 1),
        ([], 8, 8),
        (["parallel.strategy=grad_op"], 4, 4),
        (["parallel.strategy=hybrid", "parallel.shard_degree=4"], 16, 4),
        (["parallel.strategy=replicate"], 4, 1),
    ],
)
def test_model_states_are_16_bytes_per_param_over_shard_degree(
    precision: str, overrides: list[str], world: int, shard: int
) -> None:
    # ZeRO arithmetic: fp32 master params (4) + fp32 grads (4) + AdamW m, v (4 + 4).
    # FSDP2 keeps the sharded params fp32 in every preset and casts only the
    # all-gathered copy, so mixed precision changes nothing here.
    cfg = _cfg(f"precision.mode={precision}", *overrides)
    sc = scenario(cfg, world_size=world)
    params = sc.model.num_params()
    states = model_states(sc)
    assert states == {
        "sharded_params": 4 * params // shard,
        "gradients": 4 * params // shard,
        "optimizer_states": 8 * params // shard,
    }
    assert sum(states.values()) == 16 * params // shard
    assert plan(cfg, world_size=world).memory.model_states == states


def test_uneven_dims_are_padded_like_fsdp2() -> None:
    # dim 0 of every parameter is padded to a multiple of the shard group size
    sc = scenario(_cfg("model.vocab_size=1001", "model.tie_embeddings=false"), world_size=8)
    # ceil(1001/8) rows of the embedding and the head, ceil(256/8) of the norm
    assert [u.sharded for u in sc.edges] == [126 * 256, 32, 126 * 256]
    assert [u.gathered for u in sc.edges] == [8 * 126 * 256, 8 * 32, 8 * 126 * 256]
    assert sc.root.numel == 0  # an untied model's root holds nothing else


def test_block_event_model_is_consistent() -> None:
    for e in (4, 2):
        s = Sizes(n=512, d=256, f=688, heads=8, kv_heads=4, head_dim=32, vocab=2048, e=e)
        fwd = sum(n for _, n in block_forward(s, keep=True))
        # the saved set (holding the input itself in fp32), plus the output, minus the
        # input (counted by the caller; freed in low precision, saved as is in fp32)
        assert fwd == saved_per_block(s) + s.nde - (s.nd4 if e == 4 else s.nde)
        grads = sum(n for c, n in block_backward(s) if c == "unsharded_grads")
        assert grads == (2 * 256 + 4 * 256 * 256 + 3 * 256 * 688 - 2 * 256 * 128) * e
        assert sum(n for c, n in block_backward(s) if c == "activations") < 0


def test_sdpa_grouped_query_attention_saves_kv_unrepeated() -> None:
    # transformers' sdpa path ([Note: transformers' Llama in the plan]): k and v are
    # saved at their 4 heads, not repeated to the 8 query heads; the backward frees
    # every saved tensor and leaves the same weight grads and input grad
    rep = Sizes(n=512, d=256, f=688, heads=8, kv_heads=4, head_dim=32, vocab=2048, e=4)
    gqa = replace(rep, gqa=True)
    assert saved_per_block(rep) - saved_per_block(gqa) == 2 * (rep.nqe - rep.nke)
    for s in (rep, gqa):
        fwd = sum(n for _, n in block_forward(s, keep=True))
        assert fwd == saved_per_block(s) + s.nde - s.nd4
        bwd = block_backward(s)
        assert sum(n for c, n in bwd if c == "activations") == -saved_per_block(s)
    rest = [sum(n for c, n in block_backward(s) if c != "activations") for s in (gqa, rep)]
    assert rest[0] == rest[1]


def test_transformers_block_variants_free_what_they_save() -> None:
    # sdpa's own GQA and transformers' RMSNorm (weight * x.to(dtype)), in fp32 and bf16:
    # the forward keeps exactly the saved set, the backward frees all of it; in fp32 the
    # norm variant is the built-in's, in bf16 it saves the cast, not an fp32 copy
    base = Sizes(n=512, d=256, f=688, heads=8, kv_heads=4, head_dim=32, vocab=2048, e=2)
    for e in (4, 2):
        for gqa in (False, True):
            s = replace(base, e=e, gqa=gqa, norm_casts_first=True)
            fwd = sum(n for _, n in block_forward(s, keep=True))
            assert fwd == saved_per_block(s) + s.nde - (s.nd4 if e == 4 else s.nde)
            bwd = sum(n for c, n in block_backward(s) if c == "activations")
            assert bwd == -saved_per_block(s)
            built_in = replace(s, norm_casts_first=False)
            saved_less = 2 * (s.nd4 + 4 * s.d - s.nde) if e == 2 else 0
            assert saved_per_block(built_in) - saved_per_block(s) == saved_less


def test_peak_and_breakdown_add_up() -> None:
    p = plan(_cfg("data.seq_len=128", "train.chunked_loss=off"), world_size=2)
    peak = p.memory.peak
    assert sum(peak.breakdown.values()) == peak.bytes
    assert peak.phase == "backward" and "log-softmax" in peak.where  # no AC: the logits
    ac = plan(_cfg("data.seq_len=128", "activations.mode=full"), world_size=2).memory.peak
    assert ac.bytes < peak.bytes and "layers" in ac.where


def test_grad_accumulation_keeps_unsharded_fp32_grads() -> None:
    # FSDP2 without reduce-scatter (no-sync micro-batches) accumulates whole gradients
    # in the reduce dtype until the last micro-batch: 4 bytes per parameter per rank
    two = plan(_cfg("train.grad_accum=2", "train.micro_batch_size=2"), world_size=8).memory
    params = scenario(_cfg(), world_size=8).model.num_params()
    assert two.peak.breakdown["unsharded_grads"] >= 4 * params


def test_405b_at_1024_ranks_plans_its_optimizer_shard() -> None:
    # how long it takes (well under a second) is bench/wall_clock.py's to measure
    cfg = load(None, ["model.preset=llama3-405b", "data.seq_len=8192", "train.micro_batch_size=1"])
    p = plan(cfg, world_size=1024, device=parse_device("h100"))
    assert p.memory.model_states["optimizer_states"] == pytest.approx(
        8 * p.scenario.model.num_params() / 1024, rel=1e-3
    )


LLAMA3_8B = ["model.preset=llama3-8b", "data.seq_len=8192", "train.micro_batch_size=2"]


def test_llama3_8b_on_8_h100s() -> None:
    # published setting (torchtitan): 8 ranks, bf16 + fp32 reduce, local batch 2 x 8192
    cfg = load(None, [*LLAMA3_8B, "activations.mode=full", "train.chunked_loss=off"])
    full = plan(cfg, world_size=8, device=parse_device("h100"))
    assert full.scenario.precision == "bf16"
    assert 35 * GiB < full.memory.peak.bytes < 45 * GiB  # see docs/planner.md
    assert full.fits
    # at the peak: log-probabilities, nll's grad and log-softmax's grad, fp32 N x V each
    assert full.memory.peak.breakdown["logits_loss"] == 3 * 2 * 8192 * 128256 * 4


def test_communication_volumes() -> None:
    sc = scenario(_cfg(), world_size=4)
    root, blocks = sc.root, sc.units
    p = plan(_cfg(), world_size=4)
    gathered = [u.gathered * 4 for u in [root, *blocks]]
    # forward: every unit; backward: the units resharded after forward (not the root,
    # not the last block)
    again = sum(gathered) - gathered[0] - gathered[-1]
    expected = sum(gathered) * 3 // 4 + again * 3 // 4
    assert p.comm.all_gather == pytest.approx(expected, rel=1e-6)
    assert p.comm.reduce_scatter == pytest.approx(sum(gathered) * 3 // 4, rel=1e-6)
    assert p.comm.all_reduce == 0
    rep = plan(_cfg("parallel.strategy=replicate"), world_size=4).comm
    assert rep.all_gather == rep.reduce_scatter == 0
    assert rep.all_reduce == pytest.approx(2 * 3 / 4 * 4 * sc.model.num_params(), rel=1e-6)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("80GiB", 80 * GiB), ("40GB", 40 * 10**9), ("81920MiB", 80 * GiB), ("1.5 TiB", 3 * 2**39)],
)
def test_sizes(text: str, expected: int) -> None:
    assert parse_size(text) == expected
    assert parse_device(text).memory == expected


def test_devices() -> None:
    assert parse_device("H100").name == "h100"
    assert parse_device("a100-40gb").memory == int(39.4 * GiB)
    assert parse_device("cpu:64GiB").memory == 64 * GiB and parse_device("cpu").kind == "cpu"
    with pytest.raises(DeviceError, match="h100"):
        parse_device("h10")
    with pytest.raises(DeviceError, match="memory size"):
        parse_device("80XB")


def test_auto_precision_follows_the_device() -> None:
    cfg = load(None, [*EVEN])  # precision.mode = auto
    assert scenario(cfg, world_size=2, device=parse_device("h100")).precision == "bf16"
    assert scenario(cfg, world_size=2, device=parse_device("v100-32gb")).precision == "fp32"
    assert scenario(cfg, world_size=2).precision == "fp32"
    assert any("auto" in n for n in scenario(cfg, world_size=2).notes)


def test_bad_input_names_the_field() -> None:
    with pytest.raises(ConfigError, match="shard_degree"):
        plan(_cfg("parallel.strategy=hybrid", "parallel.shard_degree=3"), world_size=8)
    with pytest.raises(PlanError, match="world-size"):
        plan(_cfg(), world_size=0)
    with pytest.raises(PlanError, match=r"model\.factory"):
        plan(_cfg("model.factory=pkg.mod:fn"), world_size=2)
    with pytest.raises(PlanError, match="device memory"):
        recommend(_cfg(), world_size=2, device=Device("gpu", "gpu", None))


def test_fit_verdict_uses_margin_and_reserve() -> None:
    dev = parse_device("1GiB")
    p = plan(_cfg(), world_size=2, device=dev, margin=0.5)
    assert p.usable_bytes == int((GiB - dev.runtime_reserve) * 0.5)
    tiny = plan(_cfg(), world_size=2, device=parse_device("cpu:1GiB"))
    assert tiny.fits and tiny.headroom is not None and tiny.headroom > 0


def test_recommend_finds_a_fitting_config_and_explains() -> None:
    cfg = load(None, LLAMA3_8B)
    rec = recommend(cfg, world_size=8, device=parse_device("h100"))  # timed: bench/wall_clock.py
    assert rec.current is not None and not rec.current.fits  # no AC: ~148 GiB
    assert rec.best is not None and rec.best.fits
    # checkpointing is needed to fit: every block (2 x 8192), or every 2nd block with
    # 1 x 8192 x 2 micro-batches reduce-scattered each (parallel.accum_sync = every)
    assert rec.best.changes.get("activations.mode") in ("full", "every", "selective")
    assert [c.cost.total_s for c in rec.ranked] == sorted(c.cost.total_s for c in rec.ranked)
    text = format_recommendation(rec)
    assert "[activations]" in text and 'mode = "' in text
    assert "does not fit" in text


def test_recommend_when_nothing_fits() -> None:
    # (at 8 ranks context parallelism + offload fits it: one rank has no tp / cp layout)
    cfg = load(None, ["model.preset=llama3-405b", "data.seq_len=16384", "train.micro_batch_size=1"])
    rec = recommend(cfg, world_size=1, device=parse_device("h100"))
    assert rec.best is None and rec.fitting == 0
    assert "nothing fits" in format_recommendation(rec)


def test_json_scenario_keeps_its_degree_keys_and_their_places() -> None:
    """``--json`` scripts read world_size, replicate, shard (the cp-folded FSDP group),
    tp, cp, pp, ep where they stood when Scenario held them as fields."""
    sc = scenario(_cfg("parallel.tp=2", "parallel.cp=2"), world_size=16, ranks_per_node=8)
    got = plan_dict(plan(_cfg("parallel.tp=2", "parallel.cp=2"), world_size=16))["scenario"]
    keys = list(got)
    assert keys[:4] == ["world_size", "replicate", "shard", "strategy"]
    assert keys[keys.index("cp_attention") - 2 : keys.index("cp_attention")] == ["tp", "cp"]
    assert keys[keys.index("experts") + 1 : keys.index("experts") + 4] == ["pp", "ep", "routing"]
    assert "dims" not in got
    degrees = {k: got[k] for k in ("world_size", "replicate", "shard", "tp", "cp", "pp", "ep")}
    assert degrees == dict(world_size=16, replicate=1, shard=sc.dims.fsdp_shard, tp=2, cp=2,
                           pp=1, ep=1)  # fmt: skip
    assert sc.dims.fsdp_shard == 2 * sc.dims.shard == 8  # 16 / (tp 2 x cp 2) x cp 2


def test_reports() -> None:
    p = plan(_cfg(), world_size=2, device=parse_device("cpu:8GiB"))
    text = format_plan(p)
    assert "peak" in text and "FITS" in text and "communication" in text
    json.dumps(plan_dict(p))
    assert toml_lines({"parallel.strategy": "hybrid", "parallel.shard_degree": 8}) == (
        '[parallel]\nstrategy = "hybrid"\nshard_degree = 8'
    )


def test_async_checkpoint_staging_is_planned_on_the_host() -> None:
    # issue 15: the staging buffers async saves keep (sharded params + AdamW states)
    off = plan(_cfg("checkpoint.every=10"), world_size=2)
    on = plan(_cfg("checkpoint.every=10", "checkpoint.async_save=true"), world_size=2)
    states = on.memory.model_states
    assert off.memory.staging_bytes == 0
    assert on.memory.staging_bytes == states["sharded_params"] + states["optimizer_states"]
    assert on.memory.peak.bytes == off.memory.peak.bytes  # device peak unchanged
    assert "async checkpoint staging" in format_plan(on)


TINY_BF16 = [*PLAN_T, "precision.mode=bf16", "parallel.strategy=full"]


def test_a_units_last_gradient_lives_through_its_reduce_scatter() -> None:
    # FSDP2's foreach_reduce keeps the unit's last gradient in a loop variable until the
    # reduce-scatter returns ([Note: the last gradient]); the built-in block's last
    # parameter is down_proj's (d x f). bf16 at world 2 peaks in layers.1's reduce-scatter
    # (its fp32 input, gloo's clone of it, the fp32 output), where the unsharded bf16
    # gradients still live are the tied head's (vocab x d, until the embedding's
    # backward), the final norm's (d) and down_proj's: 2 * (1024*128 + 128 + 128*344).
    # bench/plan_accuracy.py's "T bf16 full" (this run) measured 6678912 bytes.
    peak = plan(load(None, TINY_BF16), world_size=2, trace=False).memory.peak
    assert (peak.phase, peak.where) == ("backward", "backward of layers.1")
    assert peak.breakdown["unsharded_grads"] == 2 * (1024 * 128 + 128 + 128 * 344)
    assert peak.bytes == 6678800
    # replicate: a shard group of one rank never runs that loop, nothing is held
    sc = scenario(load(None, [*TINY_BF16, "parallel.strategy=replicate"]), world_size=2)
    assert sc.units[0].last_grad_numel == 128 * 344
    assert last_grad_bytes(sc=sc, s=Step(sc).s, unit=sc.units[0], accumulated=False) == 0
