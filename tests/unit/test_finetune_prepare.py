"""model.freeze and [lora] on meta-built models: what trains, what is refused (no process group)."""

from __future__ import annotations

import pytest
import torch

from fsdpkit.config import ConfigError, load
from fsdpkit.finetune import FinetuneError, base_view, matches, prepare
from fsdpkit.models.factory import build_model
from fsdpkit.precision import PRESETS

pytest.importorskip("peft")

TINY = ["model.n_layers=2", "model.dim=32", "model.n_heads=4", "model.n_kv_heads=2"]


def _prepared(*overrides: str, precision: str = "fp32") -> tuple[torch.nn.Module, object]:
    cfg = load(None, [*TINY, *overrides])
    built = build_model(cfg.model, vocab_size=64, seq_len=16, seed=0)
    ft = prepare(built.module, cfg, precision=PRESETS[precision], init=built.init)
    return built.module, ft


def test_name_globs_match_whole_names_or_suffixes() -> None:
    assert matches("q_proj", "model.layers.0.self_attn.q_proj")
    assert matches("model.layers.1.*", "model.layers.1.mlp.up_proj.weight")
    assert not matches("proj", "model.layers.0.self_attn.q_proj")
    assert matches("*attn*", "model.layers.0.self_attn.q_proj")


def test_freeze_counts_and_first_line() -> None:
    model, ft = _prepared('model.freeze=["embed_tokens.weight","model.layers.0.*"]')
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert "model.embed_tokens.weight" in frozen  # tied head: the same tensor
    assert {n for n in frozen if n.startswith("model.layers.0.")}
    assert not any(n.startswith("model.layers.1.") for n in frozen)
    assert (
        ft.counts.trainable + sum(p.numel() for p in model.parameters() if not p.requires_grad)
        == ft.counts.total
    )
    assert "parameters trainable" in ft.describe()


def test_lora_all_linear_targets_the_blocks_and_freezes_the_rest() -> None:
    model, ft = _prepared("lora.rank=4")
    assert len(ft.targets) == 14  # 7 linear layers x 2 blocks, not the head
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all(p.is_meta for p in model.parameters())  # nothing allocated before sharding
    with base_view(model):  # the base model's own names while the base is initialized
        names = {n for n, _ in model.named_parameters()}
    assert "model.layers.0.self_attn.q_proj.weight" in names and not any("lora" in n for n in names)
    assert "model.layers.0.self_attn.q_proj.base_layer.weight" in dict(model.named_parameters())


def test_lora_trainable_modules_and_bf16_base() -> None:
    model, ft = _prepared(
        "lora.rank=4",
        'lora.targets=["q_proj","v_proj"]',
        'lora.trainable=["model.norm"]',
        precision="bf16",
    )
    assert len(ft.targets) == 4 and ft.trainable_modules == ["model.norm"]
    params = dict(model.named_parameters())
    assert params["model.norm.weight"].requires_grad
    assert params["model.norm.weight"].dtype == torch.float32
    assert params["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16  # frozen base
    assert params["model.layers.0.self_attn.q_proj.lora_A.default.weight"].dtype == torch.float32
    assert "frozen base stored in bfloat16" in ft.describe()


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (['lora.targets=["qkv_proj"]'], "'qkv_proj' matches no modules"),
        (['lora.targets=["self_attn"]'], "no Linear or Conv1D layer"),
        (['lora.trainable=["embeddings"]'], "lora.trainable: the pattern 'embeddings'"),
        (['lora.targets=["q_proj"]', 'lora.trainable=["q_proj"]'], "both a LoRA target"),
    ],
)
def test_lora_patterns_that_cannot_apply_are_refused(overrides: list[str], needle: str) -> None:
    with pytest.raises(FinetuneError, match=needle):
        _prepared("lora.rank=4", *overrides)


def test_freeze_everything_or_nothing_matched_is_refused() -> None:
    with pytest.raises(FinetuneError, match="matches no parameters"):
        _prepared('model.freeze=["encoder.*"]')
    with pytest.raises(FinetuneError, match="nothing to train"):
        _prepared('model.freeze=["*"]')


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["lora.rank=-1"], "lora.rank"),
        (["lora.rank=8", "lora.targets=[]"], "lora.targets is empty"),
        (["lora.base_dtype=bf16", "precision.mode=fp32"], "needs bf16 compute"),
        (["checkpoint.adapters_only=true"], "adapters_only"),
        (["data.format=sft"], "needs data.path"),
    ],
)
def test_config_rules(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load(None, overrides)
