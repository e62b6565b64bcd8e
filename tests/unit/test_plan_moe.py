"""The planner and doctor on mixture-of-experts models (issue 36, item 5): total vs
active parameters, the routed-activation and router-buffer notes, doctor's checks.

The measured side (the traced peak against real gloo ranks) is
tests/distributed/test_planner_accuracy.py's "hf mixtral" row and bench/plan_accuracy.py's
HX / HQ3 rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from tiny_hf import tiny_config, write_tiny_model

from fsdpkit.config import load
from fsdpkit.doctor.expert_check import expert_checks
from fsdpkit.doctor.model import plan_units
from fsdpkit.loss.router import router_spec
from fsdpkit.models.experts import Experts, experts_of, is_routed
from fsdpkit.planner import plan
from fsdpkit.planner.experts.routed import moe_notes
from fsdpkit.planner.formatting import describe_scenario, plan_dict
from fsdpkit.sharding import choose_blocks


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("moe") / "mixtral"
    return write_tiny_model(out, arch="mixtral", weights=False, tokenizer=False)


def _meta(config: object) -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def test_published_totals_and_active_counts_of_two_public_shapes() -> None:
    """Mixtral-8x7B: 46.7B total, 12.9B active; Qwen3-30B-A3B: 30.5B, 3.3B (their
    model cards); built on meta from their published config values."""
    mixtral = transformers.MixtralConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
        num_experts_per_tok=2,
    )  # fmt: skip
    qwen = transformers.Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, tie_word_embeddings=False,
    )  # fmt: skip
    m = experts_of(_meta(mixtral))
    q = experts_of(_meta(qwen))
    assert m is not None and q is not None
    assert (round(m.total / 1e9, 1), round(m.active / 1e9, 1)) == (46.7, 12.9)
    assert (round(q.total / 1e9, 1), round(q.active / 1e9, 1)) == (30.5, 3.4)
    assert (m.count, m.top_k, m.layers, q.count, q.top_k, q.layers) == (8, 2, 32, 128, 8, 48)


def test_shared_experts_and_routers_are_active_for_every_token() -> None:
    model = _meta(tiny_config("qwen2_moe"))
    found = experts_of(model)
    assert found is not None
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert found.routed == routed
    assert not is_routed("model.layers.0.mlp.shared_expert.up_proj.weight")
    assert not is_routed("model.layers.0.mlp.gate.weight")
    assert is_routed("model.layers.0.block_sparse_moe.experts.3.w1.weight")
    assert found.active == found.total - routed + routed * found.top_k // found.count


def test_a_dense_model_has_no_experts() -> None:
    assert experts_of(_meta(tiny_config("llama"))) is None


def test_the_plan_header_and_json_give_total_and_active(mixtral: Path) -> None:
    cfg = load(None, [f"model.hf={mixtral}", "data.seq_len=64", "train.micro_batch_size=2"])
    p = plan(cfg, world_size=4, trace=True)
    sc = p.scenario
    assert sc.experts is not None
    header = describe_scenario(sc)
    assert f"{sc.experts.total / 1e6:.1f}M params, {sc.experts.active / 1e6:.1f}M active" in header
    assert plan_dict(p)["scenario"]["experts"]["active"] == sc.experts.active
    notes = "\n".join(sc.notes)
    rows = 2 * 64 * sc.experts.top_k
    assert f"runs {rows} rows per micro-batch" in notes
    assert "balanced and worst routing alike" in notes
    values = sc.experts.layers * 4 * 2 * 64 * sc.experts.count  # layers x dp x tokens x E
    assert f"= {values:,} values" in notes and "kept for backward" in notes
    # step time ranks by active parameters: 6 per token each
    assert sc.flops_per_token == 6.0 * sc.experts.active


def test_notes_of_a_routing_dependent_kernel_and_an_off_router_loss() -> None:
    eager = Experts(
        family="x", count=8, top_k=2, total=100, routed=80, layers=2, implementation="eager"
    )
    (_, routed) = moe_notes(eager, None, dp=2, tokens=16)
    assert "does not bound the worst (every one of a layer's 16 tokens" in routed
    model = _meta(tiny_config("mixtral"))
    off = router_spec(model, coef=0.0)
    notes = moe_notes(experts_of(model), off, dp=2, tokens=16)
    assert "freed at once (coefficient 0)" in notes[-1]
    assert moe_notes(None, None, dp=2, tokens=16) == ()


def _doctor(overrides: list[str], model_dir: Path) -> dict[str, object]:
    cfg = load(None, [f"model.hf={model_dir}", *overrides])
    model = _meta(transformers.AutoConfig.from_pretrained(model_dir))
    units = plan_units(choose_blocks(model).blocks, cfg)
    return {c.name: c for c in expert_checks(model, units, cfg)}


def test_doctor_names_the_experts_and_warns_when_the_router_loss_is_off(mixtral: Path) -> None:
    checks = _doctor([], mixtral)
    assert checks["experts"].status == "ok"  # type: ignore[attr-defined]
    assert "active per token" in checks["experts"].message  # type: ignore[attr-defined]
    assert "sharded with its block" in checks["experts"].message  # type: ignore[attr-defined]
    assert checks["router loss"].status == "ok"  # type: ignore[attr-defined]
    off = _doctor(["model.router_aux_loss_coef=0"], mixtral)["router loss"]
    assert off.status == "warn" and "model.router_aux_loss_coef" in off.fix  # type: ignore[attr-defined]
    lora = _doctor(["lora.rank=4"], mixtral)["experts"]
    assert "stay frozen unless lora.trainable" in lora.message  # type: ignore[attr-defined]


def test_doctor_says_nothing_about_experts_for_a_dense_model(tmp_path: Path) -> None:
    dense = write_tiny_model(tmp_path / "llama", arch="llama", weights=False, tokenizer=False)
    assert _doctor([], dense) == {}
