"""A step in which one ep rank's experts receive no rows still trains right ([Note: a
rank that receives no rows] in fsdpkit.sharding.experts.dispatch).

Every router is made to pick experts 0 .. top_k - 1 for every token, which at ep 2 all
live on ep rank 0: rank 1 computes on zero rows in every layer. Found by
bench/expert_parallel.py at ep 4 (a crash at step 5 of a real routing); transformers'
expert loops return a tensor outside the graph for zero rows, which would leave the
peers waiting in the all-to-alls' backward. 2 gloo ranks, fp32, 3 AdamW steps, against
one process with the same routing: losses, grad norms and final parameters within 1e-5.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from fsdpkit import build_mesh, shard
from fsdpkit.config import load, parallel_dims
from fsdpkit.loss.contract import next_token_loss
from fsdpkit.loss.router import with_router_loss
from fsdpkit.models.factory import build_model
from fsdpkit.testing import run_ranks
from support import adamw, full_state, global_batches, train

pytestmark = pytest.mark.distributed

VOCAB, STEPS = 128, 3
SHAPE = ["data.seq_len=16", "model.router_aux_loss_coef=0.1"]


def _first_experts(self: Any, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A router (built-in or transformers' Qwen3-MoE) that sends every token to experts
    0 .. k-1, weighted by their renormalized probabilities (the router still learns)."""
    logits = F.linear(x.reshape(-1, self.weight.shape[1]), self.weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    index = torch.arange(self.top_k, device=x.device).expand(logits.shape[0], -1)
    weights = probs.gather(-1, index)
    return logits, (weights / weights.sum(dim=-1, keepdim=True)).to(logits.dtype), index


def _routed_to_rank0() -> None:
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    from fsdpkit.models.moe import TopKRouter

    TopKRouter.forward = _first_experts  # type: ignore[method-assign]
    modeling_qwen3_moe.Qwen3MoeTopKRouter.forward = _first_experts  # type: ignore[method-assign]


def _model(overrides: list[str], *, sharded: bool, hf: str | None = None) -> Any:
    """The model of ``overrides`` sharded over the ranks, or whole in one process
    (``hf``: ``from_pretrained`` of that directory, as the run reads it)."""
    if hf is not None:
        import transformers

        return transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).train()
    cfg = load(None, overrides if sharded else [*overrides, "model.meta_init=false"])
    built = build_model(cfg.model, vocab_size=VOCAB, seq_len=16, seed=0)
    if sharded:
        world = torch.distributed.get_world_size()
        dims = parallel_dims(cfg, world_size=world, local_world_size=world)
        mesh = build_mesh(dims, device_type="cpu")
        shard(built.module, cfg, mesh=mesh, init=built.init)
    return built.module


def _train(model: Any, **where: int) -> dict[str, Any]:
    loss_fn = with_router_loss(next_token_loss, model=model, coef=None)
    out = train(
        model, global_batches(STEPS, vocab=VOCAB), loss_fn=loss_fn, opt=adamw(model), **where
    )
    return {**out, "params": full_state(model), "metrics": loss_fn.step_metrics()}


def _rank(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    _routed_to_rank0()
    model = _model([*overrides, "parallel.ep=2"], sharded=True)
    return _train(model, rank=rank, world=world, dp_world=world)


def _hf_dir(tmp: Path) -> str:
    from tiny_hf import write_tiny_model

    os.environ["HF_HUB_OFFLINE"] = "1"
    return str(write_tiny_model(tmp / "qwen3_moe", arch="qwen3_moe", vocab_size=VOCAB, dim=32))


@pytest.mark.parametrize("family", ["built-in", "qwen3_moe"])
def test_a_rank_without_rows_trains_as_one_process(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hf = None if family == "built-in" else _hf_dir(tmp_path)
    overrides = [
        *(
            ["model.preset=moe-tiny", f"model.vocab_size={VOCAB}"]
            if hf is None
            else [f"model.hf={hf}"]
        ),
        *SHAPE,
    ]
    ranks = run_ranks(_rank, world_size=2, args=(overrides,), timeout_s=300)
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    from fsdpkit.models.moe import TopKRouter

    monkeypatch.setattr(TopKRouter, "forward", _first_experts)
    monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeTopKRouter, "forward", _first_experts)
    ref = _train(_model(overrides, sharded=False, hf=hf))
    for r in ranks:
        # rank 1 received nothing: the busiest rank (0) got both ranks' rows, 2x balanced
        assert r["metrics"]["moe_imbalance"] == pytest.approx(2.0)
        for key in ("loss", "norm"):
            torch.testing.assert_close(
                torch.tensor(r[key]), torch.tensor(ref[key]), rtol=0, atol=1e-5
            )
        for name, want in ref["params"].items():
            torch.testing.assert_close(r["params"][name], want, rtol=0, atol=1e-5, msg=name)
