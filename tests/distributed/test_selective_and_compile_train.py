"""Selective activation checkpointing and compiled blocks train as the plain run does.

2 gloo ranks, fp32, 10 steps through ``fsdpkit.shard``: each lever against the same
run without it, in one spawn per group (start-up dominates). Losses and final
parameters within 1e-5 relative for selective checkpointing (built-in Llama, a
transformers Llama, and a model whose blocks hold an odd number of matmuls); within
1e-4 for compiled blocks (inductor fuses and reorders the float arithmetic; measured
gaps are printed).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fsdpkit import build_mesh, init_weights, shard
from fsdpkit.config import ActivationsConfig, RunConfig, TrainConfig
from fsdpkit.loss.contract import next_token_loss
from fsdpkit.testing import run_ranks
from support import MLPNet, build, full_state, global_batches, needs_cxx, train

pytestmark = pytest.mark.distributed

STEPS = 10


class OddBlock(nn.Module):
    """Three matmuls (addmm: the linears have biases) and a residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.a, self.b, self.c = (nn.Linear(dim, dim) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.c(F.gelu(self.b(torch.tanh(self.a(self.norm(x))))))


def _hf_llama() -> nn.Module:
    """A transformers Llama as fsdpkit builds ``model.hf`` ones (no KV cache)."""
    import transformers
    from tiny_hf import tiny_config

    config = tiny_config("llama", vocab_size=128, dim=32)
    config.use_cache = False
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _odd_net() -> MLPNet:
    model = MLPNet(dim=32, depth=3, block=OddBlock)
    init_weights(model, seed=0)
    return model


# name -> (model, run config)
VARIANTS: dict[str, tuple[str, RunConfig]] = {
    "llama-none": ("llama", RunConfig()),
    "llama-selective": ("llama", RunConfig(activations=ActivationsConfig(mode="selective"))),
    "odd-none": ("odd", RunConfig()),
    "odd-selective": ("odd", RunConfig(activations=ActivationsConfig(mode="selective"))),
    "hf-none": ("hf", RunConfig()),
    "hf-selective": ("hf", RunConfig(activations=ActivationsConfig(mode="selective"))),
}
COMPILED: dict[str, tuple[str, RunConfig]] = {
    "llama-eager": ("llama", RunConfig()),
    "llama-compiled-selective": (
        "llama",
        RunConfig(activations=ActivationsConfig(mode="selective"), train=TrainConfig(compile=True)),
    ),
}


def _run(rank: int, world: int, kind: str, cfg: RunConfig) -> dict[str, Any]:
    model = {"llama": build, "odd": _odd_net, "hf": _hf_llama}[kind]()
    mesh = build_mesh(device_type="cpu")
    plan = shard(model, cfg, mesh=mesh)
    loss = next_token_loss if kind == "hf" else None  # HF returns a ModelOutput
    out = train(model, global_batches(STEPS), rank=rank, world=world, loss_fn=loss)
    out["params"] = full_state(model)
    out["names"] = sorted(name for name, _ in model.named_parameters())
    out["checkpointed"] = plan.checkpointed
    return out


def _group(rank: int, world: int, variants: dict[str, tuple[str, RunConfig]]) -> dict[str, Any]:
    return {name: _run(rank, world, kind, cfg) for name, (kind, cfg) in variants.items()}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _assert_parity(got: dict[str, Any], want: dict[str, Any], *, tol: float, what: str) -> None:
    gaps = [_rel(a, b) for a, b in zip(got["loss"], want["loss"])]
    print(f"{what}: largest relative loss gap {max(gaps):.2e}")
    for step, gap in enumerate(gaps):
        assert gap <= tol, f"{what}: step {step} loss {got['loss'][step]} vs {want['loss'][step]}"
    assert got["names"] == want["names"], f"{what}: parameter names changed"
    for key, value in want["params"].items():
        torch.testing.assert_close(
            got["params"][key], value, rtol=tol, atol=tol, msg=lambda m, k=key: f"{what} {k}: {m}"
        )


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    return _spawn(VARIANTS)


def _spawn(variants: dict[str, tuple[str, RunConfig]]) -> dict[str, Any]:
    per_rank = run_ranks(_group, world_size=2, args=(variants,), timeout_s=600)
    return per_rank[0]


@pytest.mark.parametrize("model", ["llama", "odd", "hf"])
def test_selective_matches_no_checkpointing(results: dict[str, Any], model: str) -> None:
    got, want = results[f"{model}-selective"], results[f"{model}-none"]
    blocks = {"llama": 4, "odd": 3, "hf": 2}[model]
    assert got["checkpointed"] == blocks and want["checkpointed"] == 0
    _assert_parity(got, want, tol=1e-5, what=f"{model} selective vs none")


@needs_cxx
@pytest.mark.slow
def test_compiled_blocks_match_eager() -> None:
    """Compiled blocks (with selective checkpointing inside the compiled forward)
    against eager without checkpointing; compiling dominates (~20-40 s per rank)."""
    results = _spawn(COMPILED)
    _assert_parity(
        results["llama-compiled-selective"],
        results["llama-eager"],
        tol=1e-4,
        what="compiled selective vs eager",
    )
