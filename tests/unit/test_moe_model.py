"""The built-in MoE model (fsdpkit.models.moe), its router loss and the expert-parallel
rules that need no process group: presets, transformers' Qwen3-MoE equivalence, the
capacity rule, and the refusals of ``parallel.ep`` / ``model.capacity_factor``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from fsdpkit.config import ConfigError, load, parallel_dims
from fsdpkit.init import default_init
from fsdpkit.loss.contract import next_token_loss
from fsdpkit.loss.router import with_router_loss
from fsdpkit.models.experts import experts_of
from fsdpkit.models.factory import build_model
from fsdpkit.models.moe import MoE, MoEConfig, preset
from fsdpkit.sharding.experts.dispatch import over_capacity
from fsdpkit.sharding.experts.parallel import ExpertParallelError, check_layout, check_model


def _model(**overrides: Any) -> MoE:
    model = MoE(preset("moe-tiny", tie_embeddings=False, **overrides))
    default_init(model, seed=0)
    model.init_buffers()
    return model


def qwen3_moe_config(c: MoEConfig) -> transformers.Qwen3MoeConfig:
    return transformers.Qwen3MoeConfig(
        vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.ffn_dim,
        moe_intermediate_size=c.moe_ffn_dim, num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim,
        num_experts=c.n_experts, num_experts_per_tok=c.top_k, norm_topk_prob=c.norm_topk_prob,
        rms_norm_eps=c.norm_eps, max_position_embeddings=c.max_seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=c.tie_embeddings, router_aux_loss_coef=c.router_aux_loss_coef,
    )  # fmt: skip


def test_published_shapes_count_their_published_parameters() -> None:
    """Qwen3-30B-A3B: 30.5B total, 3.3B active; Qwen3-235B-A22B: 235B, 22B (model cards)."""
    for name, total, active in (("qwen3-30b-a3b", 30.53, 3.35), ("qwen3-235b-a22b", 235.09, 22.19)):
        shape = preset(name)
        assert (round(shape.num_params() / 1e9, 2), round(shape.active_params() / 1e9, 2)) == (
            total,
            active,
        )
        with torch.device("meta"):
            found = experts_of(MoE(shape))
        assert found is not None
        assert (found.total, found.active) == (shape.num_params(), shape.active_params())
        assert (found.count, found.top_k, found.layers) == (128, 8, shape.n_layers)


def test_names_and_logits_are_transformers_qwen3_moe() -> None:
    """Rename-free: the state dict loads strictly into Qwen3MoeForCausalLM, which computes
    the same logits, loss and aux loss."""
    model = _model(router_aux_loss_coef=0.1)
    theirs = transformers.Qwen3MoeForCausalLM(qwen3_moe_config(model.config))
    theirs.load_state_dict(model.state_dict(), strict=True)
    tokens = torch.arange(2 * 17).reshape(2, 17) * 7 % 256
    torch.testing.assert_close(model(tokens), theirs(tokens).logits, rtol=0, atol=1e-5)
    ours = with_router_loss(next_token_loss, model=model, coef=None)(model, tokens)
    inputs, targets = tokens[:, :-1], tokens[:, 1:].contiguous()
    out = theirs(input_ids=inputs, labels=inputs, shift_labels=targets, output_router_logits=True)
    torch.testing.assert_close(ours, out.loss, rtol=1e-6, atol=0)


def test_shared_experts_run_for_every_token() -> None:
    model = _model(n_shared_experts=2)
    mlp = model.model.layers[0].mlp
    assert mlp.shared_experts.gate_proj.weight.shape == (2 * 32, 64)
    found = experts_of(model)
    assert found is not None and found.total == model.config.num_params()
    assert found.active == model.config.active_params()


def test_capacity_keeps_the_first_assignments_of_each_expert() -> None:
    index = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])  # 8 assignments, 4 experts
    drop = over_capacity(index, experts=4, factor=1.0)  # capacity ceil(1 x 4 x 2 / 4) = 2
    assert drop.tolist() == [[False, False], [False, False], [True, False], [False, True]]
    assert not over_capacity(index, experts=4, factor=2.0).any()


def test_capacity_dropped_assignments_compute_nothing() -> None:
    model = _model()
    experts = model.model.layers[0].mlp.experts
    hidden = torch.randn(3, 64)
    index, weights = torch.tensor([[0, 1], [2, 4], [4, 4]]), torch.rand(3, 2)  # 4: dropped
    out = experts(hidden, index, weights)
    kept = experts(hidden[:2], index[:2].clamp(max=3), weights[:2] * torch.tensor([[1, 1], [1, 0]]))
    torch.testing.assert_close(out[:2], kept, rtol=0, atol=1e-6)
    assert torch.equal(out[2], torch.zeros(64))


def _dims(*overrides: str, world: int = 8):  # type: ignore[no-untyped-def]
    return parallel_dims(load(None, list(overrides)), world_size=world, local_world_size=world)


def test_ep_is_borrowed_from_the_shard_group() -> None:
    dims = _dims("parallel.ep=4")
    assert (dims.replicate, dims.shard, dims.ep, dims.efsdp, dims.dp) == (1, 8, 4, 2, 8)
    hybrid = _dims("parallel.strategy=hybrid", "parallel.shard_degree=4", "parallel.ep=2")
    assert (hybrid.replicate, hybrid.shard, hybrid.efsdp) == (2, 4, 2)
    assert hybrid.describe() == "replicate 2 x shard 4 (ep 2 of the shard axis)"
    with_cp = _dims("parallel.ep=2", "parallel.cp=2")  # mesh (efsdp 2, cp 2, ep 2)
    assert [with_cp.dp_rank(r) for r in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]
    assert [_dims("parallel.cp=2").dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (("parallel.ep=3",), "parallel.ep = 3 does not divide the shard group (8 ranks"),
        (("parallel.strategy=replicate", "parallel.ep=2"), "strategy replicate has no shard"),
        (("parallel.ep=0",), "parallel.ep must be >= 1"),
    ],
)
def test_ep_not_dividing_the_shard_group_is_refused(overrides: tuple[str, ...], says: str) -> None:
    with pytest.raises(ConfigError) as err:
        _dims(*overrides)
    assert says in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (("parallel.ep=2",), "parallel.ep is set but model.preset = tiny is a dense model"),
        (("model.preset=moe-tiny", "parallel.ep=8"), "parallel.ep = 8 does not divide the 4"),
        (("model.preset=moe-tiny", "model.experts=6", "parallel.ep=4"), "divide the 6 routed"),
        (("model.capacity_factor=1.5",), "model.capacity_factor is set but model.preset = tiny"),
        (("model.preset=moe-tiny", "model.capacity_factor=0"), "must be > 0"),
    ],
)
def test_the_model_must_route_experts_ep_divides(overrides: tuple[str, ...], says: str) -> None:
    with pytest.raises(ExpertParallelError) as err:
        check_layout(load(None, list(overrides)))
    assert says in str(err.value)


def test_built_models_are_checked_too() -> None:
    cfg = load(None, ["model.preset=moe-tiny"])
    model = build_model(cfg.model, vocab_size=256, seq_len=16, seed=0).module
    check_model(model, ep=4, capacity=None)
    with pytest.raises(ExpertParallelError, match="does not divide the 4 routed experts"):
        check_model(model, ep=3, capacity=None)


def test_expert_overrides_belong_to_moe_presets() -> None:
    cfg = load(None, ["model.preset=moe-tiny", "model.experts=8", "model.top_k=1"])
    shape = build_model(cfg.model, vocab_size=256, seq_len=16, seed=0).llama
    assert isinstance(shape, MoEConfig) and (shape.n_experts, shape.top_k) == (8, 1)
    with pytest.raises(Exception, match=r"model\.experts sizes the experts"):
        build_model(load(None, ["model.experts=8"]).model, vocab_size=256, seq_len=16, seed=0)
