"""Which transformers families tensor parallelism splits, with which plan, and which
get sequence parallelism ([Note: tensor-parallel plans] in fsdpkit.sharding.tensor.plans):
small models of each family built on meta from their config classes (nothing is
downloaded); the planner's layout answers the trainer's rule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fsdpkit.config import load
from fsdpkit.planner.model.unit_layout import layout_of
from fsdpkit.sharding import choose_blocks
from fsdpkit.sharding.tensor.moe import moe_styles
from fsdpkit.sharding.tensor.rules import (
    EXCLUDED,
    LLAMA_BLOCK,
    MOE_BLOCK,
    REPLICATED,
    TensorParallelError,
    block_entries,
    block_plan,
    check_layout,
    check_model,
    moe_mlp,
    sequence_parallel_applies,
    sequence_parallel_block,
)

SHAPE = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "pad_token_id": None,
}


def _meta(config_class: str, **extra: Any) -> Any:
    """A ``PreTrainedModel`` of the config class's family on meta."""
    import transformers as T

    config = getattr(T, config_class)(**SHAPE, **extra)
    with torch.device("meta"):
        return T.AutoModelForCausalLM.from_config(config)


def _sequence_parallel(model: nn.Module) -> bool:
    return sequence_parallel_applies(model, blocks=list(choose_blocks(model).blocks))


@pytest.mark.parametrize(
    ("config_class", "norms", "extra"),
    [
        ("LlamaConfig", (), {}),
        ("Qwen2Config", (), {}),
        ("Qwen3Config", ("self_attn.k_norm", "self_attn.q_norm"), {"head_dim": 8}),
        ("Gemma2Config", (), {"head_dim": 8}),
        ("Gemma3TextConfig", ("self_attn.k_norm", "self_attn.q_norm"), {"head_dim": 8}),
        ("Exaone4Config", ("self_attn.k_norm", "self_attn.q_norm"), {}),
        ("MistralConfig", (), {}),
        ("GemmaConfig", (), {"head_dim": 8}),
        ("GraniteConfig", (), {}),
        ("CohereConfig", (), {}),
        ("Cohere2Config", (), {}),
        ("OlmoConfig", (), {}),
    ],
)
def test_families_with_a_plan_are_split_with_sequence_parallelism(
    config_class: str, norms: tuple[str, ...], extra: dict[str, Any]
) -> None:
    model = _meta(config_class, **extra)
    plan, source = check_model(model, tp=2, blocks=list(choose_blocks(model).blocks))
    assert "base_model_tp_plan" in source
    assert sorted(n for n, kind in plan.items() if kind == REPLICATED) == list(norms)
    linears = {n: k for n, k in plan.items() if k != REPLICATED}
    assert linears == LLAMA_BLOCK
    assert _sequence_parallel(model)
    assert layout_of(model).sequence_parallel  # the planner asks the same rule


@pytest.mark.parametrize(
    ("config_class", "family", "entry"),
    [
        ("Olmo2Config", "olmo2", "layers.*.self_attn.q_proj: colwise_gather_output"),
        ("Phi3Config", "phi3", "layers.*.self_attn.qkv_proj: colwise_gather_output"),
        ("GlmConfig", "glm", "colwise_gather_output"),
    ],
)
def test_plans_with_other_entries_are_refused_naming_family_field_and_entry(
    config_class: str, family: str, entry: str
) -> None:
    model = _meta(config_class)
    with pytest.raises(TensorParallelError) as err:
        block_plan(model, tp=2)
    text = str(err.value)
    assert f"({family})" in text and "base_model_tp_plan" in text and "parallel.tp = 2" in text
    assert entry in text, text


@pytest.mark.parametrize(
    ("config_class", "dense_entries"),
    [("MixtralConfig", False), ("Qwen2MoeConfig", True), ("Qwen3MoeConfig", True)],
)
def test_mixture_of_experts_families_take_their_attention_plan_and_fsdpkits_moe_rule(
    config_class: str, dense_entries: bool, tmp_path: Path
) -> None:
    """Since transformers 5.25 Mixtral's plan names only the attention projections,
    and Qwen2-MoE's / Qwen3-MoE's a dense ``mlp.gate_proj`` their expert layers lack
    (their dense layers have it): the attention entries apply to every block, the MLP
    entries to dense blocks only, and the expert layers are fsdpkit's ([Note: experts
    under tensor parallelism]). Passes the launcher's check (config.json alone) and the
    built model's."""
    model = _meta(config_class)
    model.config.save_pretrained(tmp_path)
    check_layout(load(None, [f"model.hf={tmp_path}", "parallel.tp=2"]))
    blocks = list(choose_blocks(model).blocks)
    plan, source = check_model(model, tp=2, blocks=blocks)
    assert "experts by fsdpkit's MoE rule" in source
    assert any(n.startswith("mlp.") for n in plan) == dense_entries
    for block in blocks:
        assert moe_mlp(block) is not None
        assert block_entries(block, plan) == [n for n in plan if n.startswith("self_attn.")]
    assert _sequence_parallel(model)


def test_olmoe_is_refused_by_its_attention_plan_naming_its_expert_count(tmp_path: Path) -> None:
    """OLMoE's q / k norms normalize the whole hidden q / k, so its plan gathers the
    projections' outputs (as dense OLMo2's): refused by those entries, in the launcher's
    check and on the built model alike; the message names the expert count too."""
    model = _meta("OlmoeConfig")
    model.config.save_pretrained(tmp_path)
    cfg = load(None, [f"model.hf={tmp_path}", "parallel.tp=2"])
    for check in (lambda: check_layout(cfg), lambda: block_plan(model, tp=2)):
        with pytest.raises(TensorParallelError) as err:
            check()
        text = str(err.value)
        assert "(olmoe)" in text and "colwise_gather_output" in text, text
        assert "parallel.tp = 2" in text and "num_local_experts = 64" in text, text


def test_the_builtin_moe_model_takes_its_attention_plan_under_tp() -> None:
    """moe-tiny at tp 2: the launcher's check passes; the plan is the attention's (with
    Qwen3's per-head norms replicated), the MLP fsdpkit's MoE rule."""
    from fsdpkit.models.moe import MoE, preset

    check_layout(load(None, ["model.preset=moe-tiny", "parallel.tp=2", "parallel.ep=2"]))
    with torch.device("meta"):
        model = MoE(preset("moe-tiny", n_shared_experts=1))
    blocks = list(choose_blocks(model).blocks)
    plan, source = check_model(model, tp=2, blocks=blocks)
    assert source == "fsdpkit's MoE plan" and plan == MOE_BLOCK
    assert plan["self_attn.q_norm"] == REPLICATED
    styles = moe_styles(blocks[0], sequence_parallel=True)
    assert set(styles) == {
        f"mlp.shared_experts{s}" for s in ("", ".gate_proj", ".up_proj", ".down_proj")
    } | {"mlp.gate"}
    assert "mlp" not in styles  # its tokens stay split: not gathered
    assert "mlp" in moe_styles(blocks[0], sequence_parallel=False)  # split, then gathered


def test_a_mixture_of_experts_mlp_with_loose_parameters_is_refused() -> None:
    from fsdpkit.models.moe import MoE, preset

    with torch.device("meta"):
        model = MoE(preset("moe-tiny"))
        model.model.layers[0].mlp.scale = nn.Parameter(torch.ones(1))
    with pytest.raises(TensorParallelError, match=r"MLP of MoEDecoderLayer holds .* \(scale\)"):
        check_model(model, tp=2, blocks=list(choose_blocks(model).blocks))


def test_a_plan_that_leaves_parameters_of_its_blocks_unplanned_is_refused() -> None:
    """Apertus' plan splits up / down around its xIELU activation, whose two scalar
    parameters it does not name: their gradients would differ between the tp ranks.
    The config alone passes (the launcher's check); the built model does not."""
    model = _meta("ApertusConfig")
    plan, _ = block_plan(model, tp=2)
    assert plan["self_attn.q_norm"] == REPLICATED
    assert sequence_parallel_block(choose_blocks(model).blocks[0])
    with pytest.raises(TensorParallelError, match=r"unplanned \(mlp\.act_fn\.alpha_p"):
        check_model(model, tp=2, blocks=list(choose_blocks(model).blocks))
    check_model(model, tp=1, cp=2, blocks=list(choose_blocks(model).blocks))  # cp alone: fine


def test_a_config_without_a_plan_is_refused_whatever_its_module_names() -> None:
    model = _meta("LlamaConfig")
    model.config.base_model_tp_plan = {}
    with pytest.raises(TensorParallelError, match=r"\(llama\).*has no entries for its layers"):
        block_plan(model, tp=2)


def test_blocks_with_other_children_or_no_final_norm_keep_the_residual_whole() -> None:
    phi = _meta("PhiConfig")  # a dropout beside attention and MLP; final_layernorm
    block_plan(phi, tp=2)  # split, but
    assert not _sequence_parallel(phi)
    assert not layout_of(phi).sequence_parallel
    block = choose_blocks(phi).blocks[0]
    assert "resid_dropout" in dict(block.named_children())
    assert not sequence_parallel_block(block)


def test_excluded_families_keep_the_residual_whole() -> None:
    model = _meta("Gemma4UnifiedTextConfig", head_dim=8, global_head_dim=8)
    assert model.config.model_type in EXCLUDED
    assert sequence_parallel_block(choose_blocks(model).blocks[0])  # its blocks match
    assert not _sequence_parallel(model)


def test_parameter_free_and_layer_norm_subclass_norms_count_as_norms() -> None:
    """OLMo's norms have no parameters; Nemotron's subclass nn.LayerNorm (LayerNorm1P)."""
    for config_class in ("OlmoConfig", "NemotronConfig"):
        model = _meta(config_class)
        assert _sequence_parallel(model), config_class
