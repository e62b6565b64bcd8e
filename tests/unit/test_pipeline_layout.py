"""Pipeline layouts without a process group: the schedule table, the stage split, the
rank layout of ``ParallelDims`` with pp, the stage modules' names, and the refusals
(each names the field and the fix)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining.schedules import get_schedule_class

from fsdpkit.checkpoint.statefuls import tied_aliases
from fsdpkit.config import ConfigError, load, parallel_dims, validate_for_world
from fsdpkit.config.schedules import SCHEDULES, micro_batch_need, stage_rank, stages_per_rank
from fsdpkit.models.llama import Llama, LlamaConfig
from fsdpkit.sharding.blocks import choose_blocks
from fsdpkit.sharding.pipeline.parts import model_ends, stage_module
from fsdpkit.sharding.pipeline.split import (
    balanced_blocks,
    check_pipeline_layout,
    split_stages,
    stage_split,
)
from fsdpkit.sharding.stage_edges import (
    SkippedBlock,
    StageInput,
    StageOutput,
    TiedHeadView,
    TiedStageInput,
)


def test_every_schedule_is_torchs() -> None:
    for name in SCHEDULES:
        assert get_schedule_class(name).__name__.lower().endswith(name.lower())


@pytest.mark.parametrize("pp,stages", [(2, 4), (4, 8), (3, 6)])
def test_v_stage_ranks_follow_torch(pp: int, stages: int) -> None:
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    ours = {s: stage_rank(s, pp=pp, style="v") for s in range(stages)}
    assert ours == generate_stage_to_rank_mapping(pp, stages, style="v")
    assert ours[0] == ours[stages - 1] == 0  # the V: first and last stage on rank 0


def test_micro_batch_needs() -> None:
    assert micro_batch_need(schedule="1F1B", pp=4, micro_batches=3) is not None
    assert micro_batch_need(schedule="1F1B", pp=4, micro_batches=4) is None
    assert micro_batch_need(schedule="GPipe", pp=4, micro_batches=1) is None
    assert micro_batch_need(schedule="ZBVZeroBubble", pp=2, micro_batches=2) is not None
    assert micro_batch_need(schedule="ZBVZeroBubble", pp=2, micro_batches=3) is None
    assert micro_batch_need(schedule="DualPipeV", pp=2, micro_batches=3) is not None
    # Interleaved: max(1, n // pp) rounds must divide n
    assert micro_batch_need(schedule="Interleaved1F1B", pp=4, micro_batches=10) is None
    assert micro_batch_need(schedule="Interleaved1F1B", pp=4, micro_batches=9) is not None


def test_stages_per_rank() -> None:
    assert stages_per_rank(schedule="1F1B", configured=None) == 1
    assert stages_per_rank(schedule="Interleaved1F1B", configured=None) == 2
    assert stages_per_rank(schedule="Interleaved1F1B", configured=3) == 3
    with pytest.raises(ConfigError, match=r"parallel\.pp_stages_per_rank = 2"):
        stages_per_rank(schedule="1F1B", configured=2)


def test_balanced_split_counts_the_edges() -> None:
    assert balanced_blocks([10] * 8, 2) == ((0, 1, 2, 3), (4, 5, 6, 7))
    # the embedding (15) and head (15) weigh on the first and last stages
    assert balanced_blocks([10] * 8, 4, first=15, last=15) == ((0,), (1, 2, 3), (4, 5, 6), (7,))
    runs = balanced_blocks([10] * 126, 16, first=200, last=210)
    assert sum(len(r) for r in runs) == 126 and all(runs)
    assert max(len(r) for r in runs[1:-1]) - min(len(r) for r in runs[1:-1]) <= 1


def _cfg(*overrides: str) -> object:
    return load(None, ["model.tie_embeddings=false", *overrides])


def test_dims_put_pp_outermost() -> None:
    cfg = _cfg("parallel.pp=2", "parallel.tp=2")
    dims = parallel_dims(cfg, world_size=8, local_world_size=8)  # type: ignore[arg-type]
    assert dims.named()[0] == ("pp", 2) and dims.dp == 2 and dims.world == 8
    # ranks 0-3 are stage 0, 4-7 stage 1; a stage's tp pair reads one batch
    assert [dims.pp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_split_of_the_run_states_blocks_and_ranks() -> None:
    cfg = _cfg("parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B")
    split = stage_split(cfg, block_params=[5] * 8, edge_params=(3, 4))  # type: ignore[arg-type]
    assert split.blocks == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert split.ranks == (0, 1, 0, 1) and split.local(0) == [0, 2]
    text = split.describe()
    assert "pp rank 0: stage 0: embedding + blocks 0-1" in text
    assert "stage 3: blocks 6-7 + norm, head, loss" in text


def _refusal(*overrides: str, world: int = 4) -> str:
    with pytest.raises(ConfigError) as err:
        cfg = load(None, list(overrides))
        validate_for_world(cfg, world_size=world, local_world_size=world)
        check_pipeline_layout(cfg)
    return str(err.value)


def test_refusals_name_the_field() -> None:
    untied = "model.tie_embeddings=false"
    batch = ["train.global_batch_size=8", "train.micro_batch_size=1"]
    assert "does not divide the world size 6" in _refusal("parallel.pp=4", untied, world=6)
    assert "fewer than its 8" in _refusal(
        "parallel.pp=4", "parallel.pp_schedule=Interleaved1F1B", untied, *batch
    )
    few = _refusal("parallel.pp=4", untied, "train.global_batch_size=6")
    assert "1F1B needs at least pp = 4 micro-batches" in few and "gives 2 micro-batch" in few
    assert "parallel.accum_sync = every" in _refusal("parallel.pp=2", "parallel.accum_sync=every")
    assert "pp_stages_per_rank = 3" in _refusal("parallel.pp=2", "parallel.pp_stages_per_rank=3")
    zbv = ("parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble", untied)
    assert "activations.mode = full with ZBVZeroBubble" in _refusal(*zbv, "activations.mode=full")


def test_tied_models_pass_at_every_schedule() -> None:
    """[Note: tied embeddings across stages]: the built-in preset (tied by default)
    under 1F1B and a V schedule, before any process starts."""
    batch = ["train.global_batch_size=8", "train.micro_batch_size=1"]
    for schedule in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble"):
        cfg = load(None, ["parallel.pp=2", f"parallel.pp_schedule={schedule}", *batch])
        validate_for_world(cfg, world_size=4, local_world_size=4)
        check_pipeline_layout(cfg)


def test_stage_modules_keep_the_models_names() -> None:
    with torch.device("meta"):
        model = Llama(LlamaConfig(n_layers=4, tie_embeddings=False))
    blocks = list(choose_blocks(model).blocks)
    ends = model_ends(model, blocks=blocks)
    assert (ends.embedding, ends.norm, ends.head) == ("model.embed_tokens", "model.norm", "lm_head")
    first = stage_module(model, ends, keep={0, 1}, first=True, last=False)
    last = stage_module(model, ends, keep={2, 3}, first=False, last=True)
    names = {n for n, _ in first.named_parameters()} | {n for n, _ in last.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}  # each exactly once
    assert not {n for n, _ in first.named_parameters()} & {n for n, _ in last.named_parameters()}
    assert isinstance(first.model.layers[2], SkippedBlock)  # type: ignore[index]
    assert isinstance(first.lm_head, StageOutput) and isinstance(
        last.model.embed_tokens, StageInput
    )
    assert last.model.layers[2] is model.model.layers[2]  # type: ignore[index]
    assert model.lm_head is last.lm_head and not isinstance(model.model.layers[0], SkippedBlock)
    h = torch.randn(2, 5, 64)
    skip = SkippedBlock(model.model.layers[0])  # type: ignore[index]
    assert skip(h, None, None, None) is h


def test_a_tied_last_stage_is_a_tied_model_under_the_models_names() -> None:
    """[Note: tied embeddings across stages]: the last stage holds the head's weight
    under the embedding's name too, so init, HF weights and checkpoints see the whole
    model's names (the alias recorded as in any tied model)."""
    with torch.device("meta"):
        model = Llama(LlamaConfig(n_layers=4, tie_embeddings=True))
    ends = model_ends(model, blocks=list(choose_blocks(model).blocks))
    assert ends.tied
    first = stage_module(model, ends, keep={0, 1}, first=True, last=False)
    last = stage_module(model, ends, keep={2, 3}, first=False, last=True)
    weight = model.model.embed_tokens.weight
    assert dict(first.named_parameters())["model.embed_tokens.weight"] is weight
    assert isinstance(last.model.embed_tokens, TiedStageInput)
    assert dict(last.named_parameters())["model.embed_tokens.weight"] is weight
    assert tied_aliases(last) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert tied_aliases(first) == {}
    both = stage_module(model, ends, keep={0, 1, 2, 3}, first=True, last=True, head=TiedHeadView())
    assert isinstance(both.lm_head, TiedHeadView) and not dict(both.lm_head.named_parameters())


def test_loose_parameters_are_refused() -> None:
    with torch.device("meta"):
        model = Llama(LlamaConfig(n_layers=2, tie_embeddings=False))
        model.scale = torch.nn.Parameter(torch.ones(1))
    with pytest.raises(ConfigError, match="outside its blocks"):
        model_ends(model, blocks=list(choose_blocks(model).blocks))


def test_stages_need_not_divide_the_blocks() -> None:
    """[Note: stage split]: as even as the blocks allow, the embedding and the head
    counted as one block each; equal stages whenever they divide the blocks."""
    assert [len(s) for s in split_stages(block_params=[1] * 126, stages=8, mode="blocks")] == [
        15,
        16,
        16,
        16,
        16,
        16,
        16,
        15,
    ]  # torchtitan's Llama 3 405B layout, with default keys
    assert [len(s) for s in split_stages(block_params=[1] * 32, stages=4, mode="blocks")] == [8] * 4
    assert [len(s) for s in split_stages(block_params=[1] * 30, stages=4, mode="blocks")] == [
        7,
        8,
        8,
        7,
    ]
    cfg = load(None, ["parallel.pp=3", "model.tie_embeddings=false", "train.global_batch_size=8",
                      "train.micro_batch_size=1"])  # fmt: skip
    validate_for_world(cfg, world_size=3, local_world_size=3)
    check_pipeline_layout(cfg)  # 4 blocks over 3 stages: no refusal
