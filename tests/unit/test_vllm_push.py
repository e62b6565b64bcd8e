"""The weight push sends what ``save_pretrained`` writes ([Note: pushing weights to the
engine]): the same names and values as the model directory, for a plain family, a
tied GPT-2 with Conv1D layers and a mixture of experts fused in memory and per expert
on disk; under LoRA, the base with the adapters folded in, while the policy itself
stays unmerged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_hf import write_tiny_model

from fsdpkit.models.hf.construct import construct
from fsdpkit.rollout.vllm.sync import largest_bytes, layout, weight_stream


def _model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def _pushed(
    model: torch.nn.Module, *, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    plan = layout(model, shadow=construct(model.config))
    return dict(weight_stream(model, plan, dtype=dtype))


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen3_moe", "mixtral"])
def test_a_push_is_what_save_pretrained_writes(tmp_path: Path, arch: str) -> None:
    folder = write_tiny_model(tmp_path / arch, arch=arch, tokenizer=False)
    saved = load_file(str(folder / "model.safetensors"))
    model = _model(folder)
    pushed = _pushed(model)
    assert sorted(pushed) == sorted(saved)
    for name, value in saved.items():
        assert torch.equal(pushed[name], value), name
    if arch in ("qwen3_moe", "mixtral"):  # fused in memory, per expert on disk
        assert any("experts.gate_up_proj" in n for n, _ in model.named_parameters())
        assert any(".experts.3." in n for n in pushed)
    largest = max(t.numel() * 4 for t in pushed.values())
    assert largest <= largest_bytes(model, dtype=torch.float32)


def test_a_push_casts_to_the_engines_dtype(tmp_path: Path) -> None:
    model = _model(write_tiny_model(tmp_path / "m", arch="llama", tokenizer=False))
    pushed = _pushed(model, dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    assert all(t.dtype == torch.bfloat16 for t in pushed.values())
    assert torch.equal(pushed["lm_head.weight"], params["lm_head.weight"].to(torch.bfloat16))


@pytest.mark.parametrize(
    ("arch", "targets"), [("llama", ["q_proj", "down_proj"]), ("gpt2", ["c_attn"])]
)
def test_lora_is_folded_into_the_push_and_the_policy_stays_unmerged(
    tmp_path: Path, arch: str, targets: list[str]
) -> None:
    from peft import LoraConfig, inject_adapter_in_model

    folder = write_tiny_model(tmp_path / arch, arch=arch, tokenizer=False)
    base = _model(folder)
    model = inject_adapter_in_model(
        LoraConfig(r=4, lora_alpha=8, target_modules=targets, fan_in_fan_out=arch == "gpt2"),
        _model(folder),
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    pushed = _pushed(model)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # unmerged
    assert not any("lora_" in n or "base_layer" in n for n in pushed)
    expected = dict(base.named_parameters())
    merged = 0
    for module_name, module in model.named_modules():
        if not hasattr(module, "base_layer"):
            continue
        delta = module.get_delta_weight("default")
        expected[f"{module_name}.weight"] = expected[f"{module_name}.weight"] + delta
        merged += 1
    assert merged == 4 if arch == "llama" else merged == 2
    for name, value in expected.items():
        torch.testing.assert_close(pushed[name], value.detach(), rtol=0, atol=1e-6)
