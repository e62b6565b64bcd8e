"""The planner's pipeline plans ([Note: pipeline plans]) without a process group:
torch's schedule orders, the bubble, the trainer's split, every rank planned and the
worst one reported, the report and JSON, and the recommender's pipeline search."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from fsdpkit.config import load
from fsdpkit.config.schedules import SCHEDULES
from fsdpkit.devices import parse_device
from fsdpkit.models.llama import Llama
from fsdpkit.planner import plan, recommend
from fsdpkit.planner.formatting import format_plan, plan_dict
from fsdpkit.planner.pipeline.degrees import pipeline_degrees
from fsdpkit.planner.pipeline.plan import (
    bubble_fraction,
    pipeline_split,
    schedule_actions,
)
from fsdpkit.planner.shapes.scenario import model_shape, scenario
from fsdpkit.sharding.blocks import choose_blocks
from fsdpkit.sharding.pipeline.parts import model_ends
from fsdpkit.sharding.pipeline.stages import _split

TINY = [
    *("model.preset=tiny", "model.dim=128", "model.n_layers=4", "model.n_heads=4"),
    *("model.n_kv_heads=2", "model.ffn_dim=344", "model.vocab_size=1024"),
    *("model.tie_embeddings=false", "data.seq_len=64", "precision.mode=fp32"),
    *("train.micro_batch_size=1", "train.global_batch_size=8"),
]  # fmt: skip


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_runs_each_micro_batch_once_per_stage(name: str) -> None:
    per_rank = SCHEDULES[name].fixed_stages or 2
    actions = schedule_actions(name, pp=2, per_rank=per_rank, n=4)
    stages = 2 * per_rank
    seen = [a for acts in actions.values() for a in acts]
    for s in range(stages):
        forwards = sorted(mb for kind, st, mb in seen if kind == "F" and st == s)
        backwards = sorted(mb for kind, st, mb in seen if kind in ("B", "I") and st == s)
        assert forwards == backwards == [0, 1, 2, 3], (name, s)
        assert sum(1 for kind, st, _ in seen if kind == "R" and st == s) == 1
    for acts in actions.values():  # REDUCE_GRAD after the stage's last backward
        for i, (kind, stage, _) in enumerate(acts):
            if kind == "R":
                assert not any(k in ("B", "W") and st == stage for k, st, _ in acts[i:])


@pytest.mark.parametrize(("pp", "n"), [(2, 4), (4, 8), (4, 4)])
def test_1f1b_bubble_over_equal_stages_is_the_textbook_one(pp: int, n: int) -> None:
    actions = schedule_actions("1F1B", pp=pp, per_rank=1, n=n)
    got = bubble_fraction(actions, costs=[1.0] * pp)
    assert got == pytest.approx((pp - 1) / (n + pp - 1))
    looped = schedule_actions("Interleaved1F1B", pp=pp, per_rank=2, n=n)
    assert bubble_fraction(looped, costs=[0.5] * 2 * pp) < got  # v stages shrink it


@pytest.mark.parametrize("tied", ["false", "true"])
def test_the_planner_splits_as_the_trainer(tied: str) -> None:
    """A tied weight counts on the first stage and the last ([Note: tied stages in the
    plan])."""
    split = ["parallel.pp=2", "parallel.pp_split=params", "model.n_layers=5"]
    cfg = load(None, [*TINY, *split, f"model.tie_embeddings={tied}"])
    with torch.device("meta"):
        model = Llama(model_shape(cfg))
    ends = model_ends(model, blocks=list(choose_blocks(model).blocks))
    sc = scenario(cfg, world_size=4)
    assert pipeline_split(cfg, sc.layout) == _split(model, ends, cfg)


def test_tied_stages_hold_what_the_trainer_gives_them() -> None:
    """[Note: tied stages in the plan]: the first stage's embedding unit and the last
    stage's head hold the tied weight each; where one rank holds both (ZBVZeroBubble),
    the last stage's copy has no optimizer state."""
    vocab, dim, shard = 1024, 128, 2
    plans, comms = {}, {}
    for tied in ("false", "true"):
        for schedule in ("1F1B", "ZBVZeroBubble"):
            pp = ["parallel.pp=2", f"parallel.pp_schedule={schedule}"]
            cfg = load(None, [*TINY, *pp, f"model.tie_embeddings={tied}"])
            pipe = plan(cfg, world_size=4).pipeline
            assert pipe is not None
            plans[tied, schedule] = [r.memory.model_states for r in pipe.ranks]
            comms[tied, schedule] = [r.comm.all_reduce for r in pipe.ranks]
    assert plans["true", "1F1B"] == plans["false", "1F1B"]  # one copy on each end
    tie = [a - b for a, b in zip(comms["true", "1F1B"], comms["false", "1F1B"], strict=True)]
    assert tie == [vocab * dim // shard * 4] * 2  # each end sends its copy's gradient
    assert comms["true", "ZBVZeroBubble"] == comms["false", "ZBVZeroBubble"]  # on one rank
    states = vocab * dim // shard * 8
    untied, tied_v = plans["false", "ZBVZeroBubble"], plans["true", "ZBVZeroBubble"]
    assert tied_v[0]["optimizer_states"] == untied[0]["optimizer_states"] - states
    assert tied_v[1] == untied[1]


def test_every_rank_is_planned_and_the_worst_reported() -> None:
    cfg = load(None, [*TINY, "parallel.pp=4"])
    p = plan(cfg, world_size=4)
    assert p.pipeline is not None and len(p.pipeline.ranks) == 4
    assert p.memory.peak.bytes == max(r.memory.peak.bytes for r in p.pipeline.ranks)
    # 1F1B: rank r keeps pp - r micro-batches in flight; the first holds the embedding
    middle = [r.memory.peak.bytes for r in p.pipeline.ranks[1:3]]
    assert middle[0] > middle[1]
    hidden = 64 * 128 * 4  # one micro-batch's hidden state, fp32
    assert [r.p2p_bytes for r in p.pipeline.ranks] == [
        8 * hidden,
        16 * hidden,
        16 * hidden,
        8 * hidden,
    ]
    text = format_plan(p)
    assert "pipeline: pp 4 x 1 stage(s) per rank, 1F1B over 8 micro-batches" in text
    assert "pp rank 3: stage 3: block 3 + norm, head, loss" in text
    assert plan_dict(p)["pipeline"]["ranks"][0]["stages"] == (0,)


def test_accumulation_under_pp_is_always_last() -> None:
    cfg = load(None, [*TINY, "parallel.pp=2", "parallel.device_mem=1GiB"])
    p = plan(cfg, world_size=4, device=parse_device("1GiB"))
    assert p.scenario.accum_sync == "last"


def test_pipeline_degrees_span_whole_nodes() -> None:
    assert pipeline_degrees(world=8, per_node=8) == []
    assert pipeline_degrees(world=64, per_node=8) == [2, 4, 8]
    assert pipeline_degrees(world=48, per_node=8) == [2]


def test_a_slow_network_makes_pp_cross_the_nodes() -> None:
    """FSDP over two nodes on a slow link waits on its all-gathers; pp 2 keeps each
    stage's FSDP inside its node and sends only hidden states across."""
    cfg = load(None, ["model.preset=llama3-8b", "data.seq_len=4096", "precision.mode=bf16",
                      "train.global_batch_size=64", "train.micro_batch_size=1",
                      "activations.mode=full"])  # fmt: skip
    slow = dataclasses.replace(parse_device("h100"), inter_gbps=1.0)
    rec = recommend(cfg, world_size=16, device=slow, ranks_per_node=8)
    assert rec.best is not None and rec.best.changes.get("parallel.pp") == 2, rec.best.changes
    fast = recommend(cfg, world_size=16, device=parse_device("h100"), ranks_per_node=8)
    assert fast.best is not None and "parallel.pp" not in fast.best.changes


FREEZE = 'model.freeze=["model.layers.0.*"]'


@pytest.mark.parametrize("tuned", ["lora.rank=8", FREEZE])
def test_a_pipelined_fine_tune_plan_says_it_is_not_yet_checked(tuned: str) -> None:
    """Measured off by -1.7% under ZBVZeroBubble (docs/planner.md): the plan says so in
    its notes (text and --json); a full pipelined run's plan does not, nor LoRA's or
    model.freeze's under 1F1B (within 0.1%)."""
    from fsdpkit.planner.api import PIPELINE_FINETUNE_NOTE

    zbv = [*TINY, "parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble", tuned]
    tuned_plan = plan(load(None, zbv), world_size=4)
    assert PIPELINE_FINETUNE_NOTE in tuned_plan.memory.notes
    assert f"note: {PIPELINE_FINETUNE_NOTE}" in format_plan(tuned_plan)
    for checked in ([], [tuned]):
        full = plan(load(None, [*TINY, "parallel.pp=2", *checked]), world_size=4)
        assert PIPELINE_FINETUNE_NOTE not in full.memory.notes


@pytest.mark.parametrize("tied", ["false", "true"])
def test_a_pipelined_dpo_reference_is_planned_in_the_stages(tied: str, tmp_path: Path) -> None:
    """[Note: reference in the plan] under pp: each pipeline rank holds its stages of
    the separate reference (fp32 here), so the ranks' reference shards add up to the
    reference of the same run without pp at the same shard degree (a tied weight: once
    per end, as the trainer's stages hold it); under LoRA there is none."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    dpo = [*TINY, "train.objective=dpo", f"data.path={pairs}", f"model.tie_embeddings={tied}"]
    pipe = plan(load(None, [*dpo, "parallel.pp=2"]), world_size=4).pipeline
    assert pipe is not None
    held = [r.memory.peak.breakdown.get("reference", 0) for r in pipe.ranks]
    flat = plan(load(None, dpo), world_size=2).memory.peak.breakdown["reference"]
    embedding = 1024 * 128 * 4 // 2  # the tied weight's second copy, fp32, shard 2
    assert sum(held) == flat + (embedding if tied == "true" else 0), (held, flat)
    assert min(held) > 0
    lora = plan(load(None, [*dpo, "parallel.pp=2", "lora.rank=4"]), world_size=4).pipeline
    assert lora is not None
    assert all(not r.memory.peak.breakdown.get("reference") for r in lora.ranks)
