"""Chunked linear cross-entropy (``train.chunked_loss``) against full logits, 2 gloo ranks.

One spawn trains every model twice with the trainer's own step (fsdpkit.trainable.step),
chunked on and off, fp32, 10 steps: the built-in Llama tied, untied (two micro-batches
per step: the head's grad accumulates without sync), tied with the root resharded after
forward (``reshard_after_forward=2`` at world size 2), an HF
``LlamaForCausalLM`` loaded by ``model.hf``, and SFT batches (answer-only targets,
packed position ids, a normalizer). Losses and final parameters agree within 1e-5
relative, and the c10d all-gathers per step are the same: the head is gathered once
per micro-batch, not once per chunk. The chunk (5 tokens) does not divide the 32
tokens of a rank's micro-batch.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdpkit import build_mesh, shard
from fsdpkit.config import ModelConfig, ParallelConfig, RunConfig
from fsdpkit.data.batch import IGNORE_INDEX, SFTBatch
from fsdpkit.loss.head import choose_loss, default_loss
from fsdpkit.models.factory import build_model
from fsdpkit.testing import run_ranks
from fsdpkit.trainable.step import train_step
from support import (
    SEQ,
    TINY,
    build,
    count_collectives,
    full_state,
    global_batches,
    local,
    untied,
)

pytestmark = pytest.mark.distributed

STEPS = 10
CHUNK = 5
VARIANTS = ("tied", "untied", "raf-2", "hf", "sft")


def _sft_batch(tokens: torch.Tensor, *, rank: int, world: int) -> SFTBatch:
    """Two packed examples per row; the first half of each is the prompt (ignored);
    the normalizer is the global answer-token count over ranks, as the loader's."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    half = SEQ // 2
    positions = torch.arange(half).repeat(2).expand(tokens.shape[0], -1).contiguous()
    prompt = positions < half // 2
    prompt[:, half] = True  # an example's first token is not predicted from the other
    targets[prompt] = IGNORE_INDEX
    normalizer = (targets != IGNORE_INDEX).sum().item() / world
    rows = slice(rank * (tokens.shape[0] // world), (rank + 1) * (tokens.shape[0] // world))
    return SFTBatch(inputs[rows], targets[rows], positions[rows], normalizer=normalizer)


def _model(variant: str, model_dir: str) -> tuple[torch.nn.Module, Any, RunConfig]:
    parallel = ParallelConfig(reshard_after_forward=2 if variant == "raf-2" else None)
    if variant == "hf":
        cfg = RunConfig(model=ModelConfig(hf=model_dir), parallel=parallel)
        built = build_model(cfg.model, vocab_size=128, seq_len=SEQ, seed=3)
        return built.module, built.init, cfg
    model = build(untied() if variant == "untied" else TINY)
    return model, None, RunConfig(parallel=parallel)


def _train(
    rank: int, world: int, variant: str, mode: str, model_dir: str, counter: Counter[str]
) -> dict[str, Any]:
    model, init, cfg = _model(variant, model_dir)
    sft = variant == "sft"
    choice = choose_loss(
        model,
        mode=mode,
        chunk_tokens=CHUNK,
        default=default_loss(sft=sft, own=None),
        custom_loss=False,
    )
    shard(model, cfg, mesh=build_mesh(), init=init)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1, eps=1e-6)
    losses, gathers = [], []
    # untied: two micro-batches per step (no-sync accumulation of the head's grad)
    for step in global_batches(STEPS, micro=2 if variant == "untied" else 1):
        micro: list[Any] = [
            _sft_batch(t, rank=rank, world=world) if sft else local(t, rank, world) for t in step
        ]
        before = counter["all_gather_single"]
        result = train_step(model, opt, micro, loss_fn=choice.loss_fn, max_norm=1.0)
        gathers.append(counter["all_gather_single"] - before)
        total = result.loss.clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    params = full_state(model)
    return {"chunked": choice.chunked, "loss": losses, "gathers": gathers, "params": params}


def _all(rank: int, world: int, model_dir: str) -> dict[str, Any]:
    counter: Counter[str] = Counter()
    count_collectives(counter, ("all_gather_single",))
    return {
        (v, mode): _train(rank, world, v, mode, model_dir, counter)
        for v in VARIANTS
        for mode in ("off", "on")
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    pytest.importorskip("transformers")
    from tiny_hf import write_tiny_model

    os.environ["HF_HUB_OFFLINE"] = "1"
    tmp = tmp_path_factory.mktemp("hf")
    model_dir = write_tiny_model(
        tmp / "llama", arch="llama", vocab_size=128, dim=32, tokenizer=False
    )
    return run_ranks(_all, world_size=2, args=(str(model_dir),), timeout_s=400)[0]  # type: ignore[no-any-return]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_loss_matches_full_logits(runs: dict[Any, Any], variant: str) -> None:
    on, off = runs[(variant, "on")], runs[(variant, "off")]
    assert on["chunked"] and not off["chunked"]
    for step, (a, b) in enumerate(zip(on["loss"], off["loss"])):
        assert _rel(a, b) <= 1e-5, f"{variant}: step {step} loss {a} (chunked) vs {b}"
    # atol as tests/distributed/test_parity.py: Adam turns rounding-level gradient
    # differences of rarely seen rows (~1e-9) into ~lr-sized steps of single elements
    for key, value in off["params"].items():
        torch.testing.assert_close(
            on["params"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}"
        )


@pytest.mark.parametrize("variant", VARIANTS)
def test_head_is_gathered_once_per_micro_batch(runs: dict[Any, Any], variant: str) -> None:
    on, off = runs[(variant, "on")], runs[(variant, "off")]
    assert on["gathers"] == off["gathers"], (on["gathers"], off["gathers"])
    assert all(g > 0 for g in on["gathers"])
