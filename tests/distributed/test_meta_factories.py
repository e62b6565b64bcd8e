"""Factory models built on the meta device train exactly as the same models built on the
CPU: non-persistent buffers (a position table; a transformers Llama's RoPE tables) are
the constructor's values, never ``to_empty`` garbage. One spawn runs every variant."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import meta_models
from fsdpkit import build_mesh, meta_params, shard
from fsdpkit.config import ModelConfig, RunConfig
from fsdpkit.loss.contract import next_token_loss
from fsdpkit.models.factory import build_model
from fsdpkit.testing import run_ranks
from support import global_batches, train

pytestmark = pytest.mark.distributed

STEPS = 10
VOCAB = 256
VARIANTS = {
    "mlp-meta": "meta_models:positional_mlp_meta",
    "mlp-cpu": "meta_models:positional_mlp_cpu",
    "llama-meta": "meta_models:hf_llama_meta",
    "llama-cpu": "meta_models:hf_llama_cpu",
}


def _variant(rank: int, spec: str, weights: str | None) -> dict[str, Any]:
    from fsdpkit.checkpoint import load_hf_weights

    built = build_model(ModelConfig(factory=spec), vocab_size=VOCAB, seq_len=16, seed=0)
    was_meta = any(p.is_meta for p in built.module.parameters())
    shard(built.module, RunConfig(), mesh=build_mesh(), init=built.init)
    if weights is not None:  # model.init_from: the same weights for both builds
        load_hf_weights(built.module, weights)
    buffers = {n: b.clone() for n, b in built.module.named_buffers()}
    batches = global_batches(STEPS, vocab=VOCAB)
    loss_fn = built.loss_fn or next_token_loss  # the factory's own loss, else the default
    losses = train(built.module, batches, rank=rank, world=2, loss_fn=loss_fn)["loss"]
    return {"meta": was_meta, "buffers": buffers, "loss": losses}


def _initial_weights(*, via_builder: bool) -> dict[str, torch.Tensor]:
    """A meta-built transformers Llama's weights right after sharding, through the
    trainer's builder (model.factory) or through the library's ``shard()`` alone."""
    if via_builder:
        built = build_model(ModelConfig(factory=VARIANTS["llama-meta"]), vocab_size=VOCAB,
                            seq_len=16, seed=0)  # fmt: skip
        model, init = built.module, built.init
    else:
        with meta_params():  # the library user's way to build on meta
            model, init = meta_models.hf_llama_cpu(), None
    shard(model, RunConfig(), mesh=build_mesh(), init=init)
    return {n: p.full_tensor().clone() for n, p in model.named_parameters()}


def _all(rank: int, world: int, llama_dir: str) -> dict[str, Any]:
    runs = {
        name: _variant(rank, spec, llama_dir if name.startswith("llama") else None)
        for name, spec in VARIANTS.items()
    }
    runs["init"] = {kind: _initial_weights(via_builder=kind == "cli") for kind in ("cli", "lib")}
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    pytest.importorskip("transformers")
    from tiny_hf import write_tiny_model

    llama = write_tiny_model(
        tmp_path_factory.mktemp("llama"), arch="llama", vocab_size=VOCAB, dim=32, tokenizer=False
    )
    return run_ranks(_all, world_size=2, args=(str(llama),), timeout_s=300)


def test_shard_and_the_trainer_give_a_transformers_model_the_same_init(
    runs: list[dict[str, Any]],
) -> None:
    """The one init rule (fsdpkit.models.hf.initialize.own_initializer): ``fsdpkit.shard`` on a
    model built under ``fsdpkit.meta_params()`` and ``fsdpkit train model.factory=...``
    both run the model's own ``_init_weights``, so they agree bit for bit."""
    for rank in runs:
        cli, lib = rank["init"]["cli"], rank["init"]["lib"]
        assert cli.keys() == lib.keys() and cli
        for name, value in cli.items():
            assert torch.equal(lib[name], value), name
        embed = cli["model.embed_tokens.weight"]
        assert abs(embed.std().item() - 0.02) < 0.005  # LlamaConfig.initializer_range


@pytest.mark.parametrize("model", ["mlp", "llama"])
def test_meta_build_trains_exactly_as_cpu_build(runs: list[dict[str, Any]], model: str) -> None:
    for rank in runs:
        meta, cpu = rank[f"{model}-meta"], rank[f"{model}-cpu"]
        assert meta["meta"] and not cpu["meta"]
        assert meta["buffers"].keys() == cpu["buffers"].keys() and meta["buffers"]
        for name, value in cpu["buffers"].items():
            assert torch.equal(meta["buffers"][name], value), name
        assert meta["loss"] == cpu["loss"]
