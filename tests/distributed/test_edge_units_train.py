"""Edge units (``parallel.edge_units``) on vs off, 2 gloo ranks, fp32, 10 steps.

An untied built-in Llama with the chunked loss and with full logits, and an untied HF
``LlamaForCausalLM`` loaded by ``model.hf``, each trained with the trainer's own step
with the embedding, final norm and head in units of their own and in the root unit:
losses, an evaluation loss under ``no_grad`` and the final parameters agree within
1e-5 relative. The collectives per step are counted: the edge units add exactly the
all-gathers and reduce-scatters the layout implies (the root then holds nothing).
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
from fsdpkit.loss.contract import next_token_loss
from fsdpkit.loss.head import choose_loss
from fsdpkit.models.factory import build_model
from fsdpkit.testing import run_ranks
from fsdpkit.trainable.step import train_step
from support import SEQ, build, count_collectives, full_state, global_batches, local, untied

pytestmark = pytest.mark.distributed

STEPS = 10
VARIANTS = ("chunked", "full-logits", "hf")
COUNTED = ("all_gather_single", "reduce_scatter_single")


def _train(
    rank: int, world: int, variant: str, edges: bool, model_dir: str, counter: Counter[str]
) -> dict[str, Any]:
    cfg = RunConfig(parallel=ParallelConfig(edge_units=edges))
    init = None
    if variant == "hf":
        cfg = RunConfig(model=ModelConfig(hf=model_dir), parallel=cfg.parallel)
        built = build_model(cfg.model, vocab_size=128, seq_len=SEQ, seed=3)
        model, init = built.module, built.init
    else:
        model = build(untied())
    mode = "off" if variant == "full-logits" else "on"
    loss_fn = choose_loss(
        model, mode=mode, chunk_tokens=7, default=next_token_loss, custom_loss=False
    ).loss_fn
    plan = shard(model, cfg, mesh=build_mesh(), init=init)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1, eps=1e-6)
    losses, counts = [], []
    batches = global_batches(STEPS + 1)
    for step in batches[:STEPS]:
        before = Counter(counter)
        result = train_step(
            model, opt, [local(step[0], rank, world)], loss_fn=loss_fn, max_norm=1.0
        )
        counts.append({k: counter[k] - before[k] for k in COUNTED})
        total = result.loss.clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    with torch.no_grad():
        evaluated = loss_fn(model, local(batches[STEPS][0], rank, world)).clone()
    dist.all_reduce(evaluated)
    return {
        "edges": plan.edges,
        "loss": losses,
        "eval": float(evaluated) / world,
        "counts": counts,
        "params": full_state(model),
    }


def _all(rank: int, world: int, model_dir: str) -> dict[Any, Any]:
    counter: Counter[str] = Counter()
    count_collectives(counter, COUNTED)
    return {
        (variant, edges): _train(rank, world, variant, edges, model_dir, counter)
        for variant in VARIANTS
        for edges in (False, True)
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    pytest.importorskip("transformers")
    from tiny_hf import write_tiny_model

    os.environ["HF_HUB_OFFLINE"] = "1"
    model_dir = write_tiny_model(
        tmp_path_factory.mktemp("hf") / "llama",
        arch="llama",
        vocab_size=128,
        dim=32,
        tokenizer=False,  # transformers' Llama config: untied
    )
    return run_ranks(_all, world_size=2, args=(str(model_dir),), timeout_s=400)[0]  # type: ignore[no-any-return]


@pytest.mark.parametrize("variant", VARIANTS)
def test_edge_units_train_like_the_root_layout(runs: dict[Any, Any], variant: str) -> None:
    on, off = runs[(variant, True)], runs[(variant, False)]
    assert on["edges"] == ("embedding", "norm", "head") and off["edges"] == ()
    for step, (a, b) in enumerate(zip(on["loss"], off["loss"])):
        assert abs(a - b) <= 1e-5 * abs(b), f"{variant}: step {step} loss {a} vs {b}"
    assert abs(on["eval"] - off["eval"]) <= 1e-5 * abs(off["eval"])
    for key, value in off["params"].items():
        torch.testing.assert_close(
            on["params"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}"
        )


@pytest.mark.parametrize("variant", VARIANTS)
def test_edge_units_add_the_collectives_of_their_layout(runs: dict[Any, Any], variant: str) -> None:
    """Per step: the root's one all-gather and reduce-scatter become the embedding's
    (gathered in forward and again for its backward), the norm's and the head's (kept
    gathered from forward to backward): +3 all-gathers, +2 reduce-scatters."""
    on, off = runs[(variant, True)], runs[(variant, False)]
    for a, b in zip(on["counts"], off["counts"]):
        assert a["all_gather_single"] == b["all_gather_single"] + 3, (a, b)
        assert a["reduce_scatter_single"] == b["reduce_scatter_single"] + 2, (a, b)
