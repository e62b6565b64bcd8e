"""One init rule (fsdpkit.models.hf.initialize.own_initializer): ``fsdpkit.init_weights`` on a
model built on the CPU gives exactly the values ``fsdpkit.shard`` gives the same model
built on the meta device, for every kind of model a user brings, at 1 and 2 ranks.

Kinds: fsdpkit's built-in Llama; a user's factory model (``model.factory``, through the
trainer's builder); a transformers ``LlamaForCausalLM`` built under
``torch.device("meta")`` and under ``fsdpkit.meta_params()``, directly and as a factory.
The sharded model's first loss must equal the unsharded reference's, and a transformers
model must carry its own init (embedding std = ``initializer_range``), not fsdpkit's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

import meta_models
from fsdpkit import build_mesh, init_weights, meta_params, shard
from fsdpkit.config import ModelConfig, RunConfig
from fsdpkit.loss.contract import next_token_loss
from fsdpkit.models.factory import build_model
from fsdpkit.models.llama import Llama
from fsdpkit.testing import run_ranks
from support import TINY

pytestmark = pytest.mark.distributed

SEED = 3
"""Not the default 0, so a rule that ignored the seed would show."""


def _built_in(*, meta: bool) -> nn.Module:
    if meta:
        with torch.device("meta"):
            return Llama(TINY)
    return Llama(TINY)


def _hf(*, meta: str | None = None) -> nn.Module:
    if meta == "device":
        with torch.device("meta"):
            return meta_models.hf_llama_cpu()
    if meta == "meta_params":
        with meta_params():
            return meta_models.hf_llama_cpu()
    return meta_models.hf_llama_cpu()


def _factory(spec: str) -> tuple[nn.Module, Any]:
    built = build_model(ModelConfig(factory=spec), vocab_size=256, seq_len=16, seed=SEED)
    return built.module, built.init


CASES: dict[str, tuple[Callable[[], tuple[nn.Module, Any]], Callable[[], nn.Module]]] = {
    "built-in": (lambda: (_built_in(meta=True), None), lambda: _built_in(meta=False)),
    "factory": (
        lambda: _factory("meta_models:positional_mlp_meta"),
        meta_models.PositionalMLP,
    ),
    "factory-transformers": (lambda: _factory("meta_models:hf_llama_meta"), _hf),
    "transformers-meta-device": (lambda: (_hf(meta="device"), None), _hf),
    "transformers-meta-params": (lambda: (_hf(meta="meta_params"), None), _hf),
}
"""kind -> (meta build and its initializer for ``shard``, CPU build for ``init_weights``)."""

EMBED_STD = {
    **dict.fromkeys(CASES, 0.02),  # transformers' _init_weights: LlamaConfig.initializer_range
    "built-in": TINY.init_std,  # Llama.param_init: normal(0, init_std), 0.02 as well
    "factory": (3 * 64) ** -0.5,  # fsdpkit's default: uniform(+-1/sqrt(fan_in = dim 64))
}
"""The embedding's std each rule gives: which rule ran, not just that the two agree."""


def _case(name: str) -> dict[str, Any]:
    meta_build, cpu_build = CASES[name]
    model, init = meta_build()
    shard(
        model, RunConfig(train=replace(RunConfig().train, seed=SEED)), mesh=build_mesh(), init=init
    )
    reference = cpu_build()
    init_weights(reference, seed=SEED)
    ref_params = dict(reference.named_parameters())
    diffs = {
        n: (p.full_tensor() - ref_params[n].detach()).abs().max().item()
        for n, p in model.named_parameters()
    }
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        loss = next_token_loss(model, tokens).item(), next_token_loss(reference, tokens).item()
    embed = next(p for n, p in ref_params.items() if "embed" in n)
    return {"diffs": diffs, "loss": loss, "embed_std": embed.std().item()}


def _all(rank: int, world: int) -> dict[str, Any]:
    return {name: _case(name) for name in CASES}


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def runs(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    pytest.importorskip("transformers")
    return run_ranks(_all, world_size=request.param, timeout_s=300)


@pytest.mark.parametrize("kind", list(CASES))
def test_init_weights_equals_shard(runs: list[dict[str, Any]], kind: str) -> None:
    for rank in runs:
        case = rank[kind]
        assert case["diffs"] and max(case["diffs"].values()) == 0.0, case["diffs"]
        sharded, reference = case["loss"]
        assert sharded == pytest.approx(reference, abs=1e-6)
        assert case["embed_std"] == pytest.approx(EMBED_STD[kind], rel=0.1)
