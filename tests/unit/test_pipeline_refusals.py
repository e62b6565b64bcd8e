"""Every refusal docs/parallelism.md lists for ``parallel.pp`` ("Refused", a
mixture-of-experts family whose router loss cannot cross the stages, the stage
boundaries), one case each, through the function that refuses: ``resolve`` (what the
launcher runs before any worker) for the config's, ``check_stage_router`` (which
``build_pipeline`` calls) and ``model_ends`` for the built model's, a
``StageModule``'s forward for the cuts. Each message must name the setting to change,
so a user reads which key refused and what to do, not only that pp did."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fsdpkit.config import ConfigError
from fsdpkit.loss.router import RouterSpec
from fsdpkit.models.llama import Llama, LlamaConfig
from fsdpkit.run.resolve import resolve
from fsdpkit.sharding.blocks import choose_blocks
from fsdpkit.sharding.pipeline.parts import model_ends, stage_module
from fsdpkit.sharding.pipeline.routing import check_stage_router
from fsdpkit.sharding.pipeline.stages import StageBoundaryError, StageModule

UNTIED = "model.tie_embeddings=false"
BATCH = ("train.global_batch_size=8", "train.micro_batch_size=1")
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")

CONFIG_REFUSALS: dict[str, tuple[tuple[str, ...], int, tuple[str, ...]]] = {
    # name: (overrides, world size, what the message must name)
    "pp below 1": (("parallel.pp=0",), 4, ("parallel.pp must be >= 1",)),
    "pp x tp x cp not dividing the world": (
        ("parallel.pp=4", UNTIED),
        6,
        ("parallel.pp x parallel.tp x parallel.cp", "world size 6"),
    ),
    "more stages than blocks": (
        ("parallel.pp=4", "parallel.pp_schedule=Interleaved1F1B", UNTIED, *BATCH),
        4,
        ("parallel.pp_stages_per_rank", "fewer than its 8"),
    ),
    "stages per rank against the schedule": (
        ("parallel.pp=2", "parallel.pp_stages_per_rank=3"),
        4,
        ("parallel.pp_stages_per_rank = 3", "parallel.pp_schedule"),
    ),
    "stages per rank below 1": (
        ("parallel.pp=2", "parallel.pp_schedule=LoopedBFS", "parallel.pp_stages_per_rank=0"),
        4,
        ("parallel.pp_stages_per_rank must be >= 1",),
    ),
    "1F1B: fewer micro-batches than pp": (
        ("parallel.pp=4", UNTIED, "train.global_batch_size=6"),
        4,
        ("parallel.pp_schedule = '1F1B'", "train.global_batch_size = 6", "2 micro-batch"),
    ),
    "ZBVZeroBubble: fewer than 2 pp - 1": (
        ("parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble", "train.global_batch_size=4"),
        4,
        ("parallel.pp_schedule = 'ZBVZeroBubble'", "2 x pp - 1 = 3", "train.global_batch_size"),
    ),
    "DualPipeV: fewer than 2 pp": (
        ("parallel.pp=2", "parallel.pp_schedule=DualPipeV", "train.grad_accum=3"),
        2,
        ("parallel.pp_schedule = 'DualPipeV'", "2 x pp = 4", "train.grad_accum = 3"),
    ),
    "Interleaved1F1B: rounds not dividing the micro-batches": (
        ("parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B", "train.grad_accum=5"),
        2,
        ("parallel.pp_schedule = 'Interleaved1F1B'", "train.grad_accum = 5"),
    ),
    "DPO with cp": (
        ("parallel.pp=2", "parallel.cp=2", "train.objective=dpo", "data.path=prefs.jsonl"),
        4,
        ("train.objective = dpo with parallel.cp",),
    ),
    "accum_sync every": (
        ("parallel.pp=2", "parallel.accum_sync=every"),
        4,
        ("parallel.accum_sync = every",),
    ),
    "accum_keep_unsharded": (
        ("parallel.pp=2", "parallel.accum_keep_unsharded=true"),
        4,
        ("parallel.accum_keep_unsharded = true",),
    ),
    "fp16 (its gradient scaler)": (
        ("parallel.pp=2", "precision.mode=fp16", "train.optimizer_impl=foreach"),
        4,
        ("precision.mode = fp16",),
    ),
    "a gradient scaler without fp16": (
        ("parallel.pp=2", "precision.mode=fp32", "precision.grad_scaler=true"),
        4,
        ("precision.grad_scaler",),
    ),
    **{
        f"train.compile with {s}": (
            ("parallel.pp=2", f"parallel.pp_schedule={s}", "train.compile=true"),
            4,
            (f"train.compile with {s}",),
        )
        for s in ZERO_BUBBLE
    },
    **{
        f"activation checkpointing with {s}": (
            ("parallel.pp=2", f"parallel.pp_schedule={s}", "activations.mode=selective"),
            4,
            (f"activations.mode = selective with {s}",),
        )
        for s in ZERO_BUBBLE
    },
}


@pytest.mark.parametrize("name", list(CONFIG_REFUSALS))
def test_config_refusal_names_its_key(name: str) -> None:
    overrides, world, named = CONFIG_REFUSALS[name]
    with pytest.raises(ConfigError) as err:
        resolve(None, overrides, world_size=world, local_world_size=world)
    message = str(err.value)
    for part in named:
        assert part in message, f"{name}: {message}"
    assert "\n" not in message.strip(), f"{name}: not one paragraph: {message}"


def test_fine_tuning_settings_pass_with_pp() -> None:
    """LoRA, model.freeze, offload.params and model.init_from split into stages (issue 50;
    tests/distributed/test_pipeline_parallel.py's lora-, freeze-, offload-, initfrom-
    layouts train as one process)."""
    batch = ["train.global_batch_size=8", "train.micro_batch_size=1"]
    for setting in ("lora.rank=4", "model.freeze=['*.self_attn.*']", "offload.params=true"):
        resolve(None, ["parallel.pp=2", *batch, setting], world_size=4, local_world_size=4)


def test_the_refused_settings_pass_without_pp() -> None:
    """The refusals are pp's: each of those settings alone resolves (those that need
    more than the config, a weights file or preference data, are left out)."""
    kept = ("lora.rank=4", "offload.params=true", "parallel.accum_sync=every")
    for setting in (*kept, "parallel.accum_keep_unsharded=true", "train.compile=true"):
        resolve(None, [setting], world_size=4, local_world_size=4)


def test_a_model_with_loose_parameters_is_refused() -> None:
    with torch.device("meta"):
        model = Llama(LlamaConfig(n_layers=2, tie_embeddings=False))
        model.scale = nn.Parameter(torch.ones(1))
    with pytest.raises(ConfigError, match=r"parallel\.pp: Llama has parameters outside .*scale"):
        model_ends(model, blocks=list(choose_blocks(model).blocks))


def test_a_router_loss_that_cannot_cross_the_stages_is_refused() -> None:
    """A family whose aux loss is not the Switch form of per-expert sums ([Note: the
    router loss across stages]); at coefficient 0 it trains (nothing to carry)."""

    def squared(logits: tuple[torch.Tensor, ...], experts: int, top_k: int) -> torch.Tensor:
        return sum((torch.softmax(x, -1) ** 2).sum() for x in logits)  # type: ignore[return-value]

    spec = RouterSpec(
        family="zloss_moe", recorder=nn.Linear, index=0, aux_fn=squared, experts=4, top_k=2,
        coef=0.01,
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"^parallel\.pp: zloss_moe's router loss .* "
                       r"model\.router_aux_loss_coef = 0"):  # fmt: skip
        check_stage_router(spec)
    check_stage_router(replace(spec, coef=0.0))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.proj(h)


class _Rescaled(nn.Module):
    """Embedding, two blocks, head; the forward scales the hidden state ``at`` a cut:
    after the embedding ("entry") or after the last block ("exit")."""

    def __init__(self, *, at: str) -> None:
        super().__init__()
        self.embed, self.head, self.at = nn.Embedding(16, 8), nn.Linear(8, 16), at
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) * (2.0 if self.at == "entry" else 1.0)
        for block in self.blocks:
            h = block(h)
        return self.head(h * (2.0 if self.at == "exit" else 1.0))  # type: ignore[no-any-return]


def _call_model(model: nn.Module, batch: SimpleNamespace) -> torch.Tensor:
    """A run's loss reduced to its model call."""
    return model(batch.tokens).sum()  # type: ignore[no-any-return]


@pytest.mark.parametrize(("at", "stage", "says"), [
    ("entry", 1, "changes the input embedding's output before its first block"),
    ("exit", 0, "output head does not read its last block's output"),
])  # fmt: skip
def test_a_forward_that_changes_the_hidden_state_at_a_cut_is_refused(
    at: str, stage: int, says: str
) -> None:
    """[Note: stage boundaries], on the stage that would pass the change on: the second
    stage's first block must get what its embedding stand-in returned, the first
    stage's head stand-in what its last block returned."""
    model = _Rescaled(at=at)
    blocks = list(model.blocks)
    ends = model_ends(model, blocks=blocks)
    part = stage_module(model, ends, keep={stage}, first=stage == 0, last=stage == 1)
    module = StageModule(part, stage=stage, last=stage == 1, loss_fn=_call_model,
                         blocks=[blocks[stage]])  # fmt: skip
    tokens = torch.zeros(1, 4, dtype=torch.long)
    module.batches = [SimpleNamespace(tokens=tokens)]
    with pytest.raises(StageBoundaryError) as err:
        module(torch.zeros(1, 4, 8) if stage else tokens)
    assert says in str(err.value) and "use parallel.pp = 1" in str(err.value)
