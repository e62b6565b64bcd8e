"""The planner on models it did not write: model.hf directories and model.factory.

Analytic where the block ops are the Llama family's (HF Llama), traced for everything
else (GPT-2, a residual MLP); the recommender traces cheapest first; parallel.auto
keeps the config and says why when the model's code cannot be traced. Accuracy
against real runs: tests/distributed/test_planner_accuracy.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_hf import tiny_config, write_tiny_model
from torch import nn

from fsdpkit.config import load
from fsdpkit.planner import PlanError, parse_device, plan, recommend
from fsdpkit.planner.formatting import format_plan
from fsdpkit.planner.model.user_models import hf_llama_shape
from fsdpkit.planner.search.auto import auto_plan
from support import MLPNet

RUN = ["data.seq_len=64", "train.micro_batch_size=2", "precision.mode=fp32"]


def token_mlp() -> nn.Module:
    """A factory model over the byte vocabulary (no attention, generic blocks)."""
    return MLPNet(vocab=256)


class _ReadsValues(MLPNet):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.max().item() > 10_000:  # data-dependent: no fake tensor can answer
            raise ValueError("token out of range")
        return super().forward(tokens)


def reads_values() -> nn.Module:
    return _ReadsValues(vocab=256)


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    for arch in ("llama", "gpt2"):
        write_tiny_model(root / arch, arch=arch, weights=False, tokenizer=False)
    return root


def test_hf_llama_is_planned_analytically_from_its_own_units(hf: Path) -> None:
    p = plan(load(None, [f"model.hf={hf / 'llama'}", *RUN]), world_size=2, trace=False)
    sc = p.scenario
    assert p.memory.mode == "analytic" and sc.source == "model.hf LlamaForCausalLM"
    assert sc.layout.block_class == "LlamaDecoderLayer" and len(sc.units) == 2
    assert sc.model is not None and sc.model.dim == 64 and sc.model.n_kv_heads == 2
    import transformers

    real = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))
    assert sc.num_params == sum(p.numel() for p in real.parameters())


def test_other_models_are_traced_and_say_so(hf: Path) -> None:
    for model in (f"model.hf={hf / 'gpt2'}", f"model.factory={__name__}:token_mlp"):
        cfg = load(None, [model, *RUN])
        p = plan(cfg, world_size=2)
        assert p.memory.mode == "traced" and p.other is None
        assert any(n.startswith("planned by tracing: ") for n in p.scenario.notes)
        assert "planned by tracing" in format_plan(p)
        with pytest.raises(PlanError, match="--trace"):
            plan(cfg, world_size=2, trace=False)  # formulas only: refused, named


def test_hf_shape_reads_the_llama_family_config() -> None:
    shape = hf_llama_shape(tiny_config("llama", dim=128, heads=4, kv_heads=1), seq_len=64)
    assert shape is not None
    assert (shape.dim, shape.n_heads, shape.n_kv_heads, shape.ffn_dim) == (128, 4, 1, 128)
    odd = tiny_config("llama")
    odd.head_dim = 32  # 4 heads x 32 != 64: not expressible as the built-in Llama
    assert hf_llama_shape(odd, seq_len=64) is None


def test_recommend_traces_cheapest_first(hf: Path) -> None:
    cfg = load(None, [f"model.hf={hf / 'gpt2'}", *RUN])
    rec = recommend(cfg, world_size=2, device=parse_device("cpu:64GiB"), top=2)
    assert rec.best is not None and rec.fitting == 2
    assert rec.considered == 2 < rec.searched  # stopped once two fit


def test_parallel_auto_plans_a_factory_model() -> None:
    cfg = load(None, [f"model.factory={__name__}:token_mlp", *RUN, "parallel.device_mem=1000GiB"])
    auto = auto_plan(cfg, world_size=2, local_world_size=2)
    assert auto.note is None  # planned (it used to say "no configuration fits")


def test_parallel_auto_keeps_the_config_of_a_model_it_cannot_trace() -> None:
    cfg = load(None, [f"model.factory={__name__}:reads_values", *RUN, "parallel.device_mem=1GiB"])
    auto = auto_plan(cfg, world_size=2, local_world_size=2)
    assert auto.changes == {}
    assert auto.note is not None and "could not plan model.factory" in auto.note
    assert "keeps its configured parallel settings" in auto.note
