"""Edge units: an untied embedding, the final norm and the head as FSDP units of their
own ([Note: edge units] in fsdpkit.sharding.edges), decided once for ``shard()`` and
the planner."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from fsdpkit.config import ActivationsConfig, ParallelConfig, RunConfig, load
from fsdpkit.doctor.model import plan_units, structure_checks
from fsdpkit.planner import parse_device, plan
from fsdpkit.planner.model.unit_layout import layout_of
from fsdpkit.sharding import choose_blocks, unit_specs
from fsdpkit.sharding.edges import edge_modules
from support import TINY, MLPNet, build, untied

GiB = 1024**3


def _edges(model: nn.Module) -> dict[str, nn.Module]:
    return edge_modules(model, blocks=choose_blocks(model).blocks)


def test_untied_llama_gets_embedding_norm_and_head_units_in_forward_order() -> None:
    model = build(untied(), meta=True)
    edges = _edges(model)
    assert list(edges) == ["embedding", "norm", "head"]
    assert edges["embedding"] is model.model.embed_tokens
    assert edges["norm"] is model.model.norm
    assert edges["head"] is model.lm_head


def test_tied_weights_and_models_without_accessors_keep_everything_in_the_root() -> None:
    assert _edges(build(TINY, meta=True)) == {}
    assert _edges(MLPNet()) == {}


def test_hugging_face_models_untied_and_tied() -> None:
    common = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    with torch.device("meta"):
        llama = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**common, tie_word_embeddings=False)
        )
        qwen = transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(**common, tie_word_embeddings=True)
        )
    edges = _edges(llama)
    assert edges == {
        "embedding": llama.model.embed_tokens, "norm": llama.model.norm, "head": llama.lm_head,
    }  # fmt: skip
    assert _edges(qwen) == {}


def test_unit_specs_order_and_resharding_of_edge_units() -> None:
    specs = unit_specs(
        4,
        parallel=ParallelConfig(blocks_per_unit=2),
        activations=ActivationsConfig(mode="full"),
        edges=("embedding", "norm", "head"),
    )
    assert [s.role for s in specs] == ["embedding", "block", "block", "norm", "head", "root"]
    # the embedding follows the strategy; norm, head, last block and root stay gathered
    assert [s.reshard_after_forward for s in specs] == [True, True, False, False, False, False]
    grad_op = unit_specs(
        2, parallel=ParallelConfig(strategy="grad_op"), activations=ActivationsConfig(),
        edges=("embedding", "head"),
    )  # fmt: skip
    assert {s.reshard_after_forward for s in grad_op} == {False}


def test_layout_moves_edge_parameters_out_of_the_root() -> None:
    layout = layout_of(build(untied(), meta=True))
    assert [e.role for e in layout.edges] == ["embedding", "norm", "head"]
    vocab, dim = TINY.vocab_size, TINY.dim
    assert [e.shapes for e in layout.edges] == [((vocab, dim),), ((dim, 1),), ((vocab, dim),)]
    assert layout.root == ()
    tied = layout_of(build(TINY, meta=True))
    assert tied.edges == () and (vocab, dim) in tied.root


def test_llama3_8b_full_ac_chunked_plan_fits_22_gib() -> None:
    """Issue 12's planned case: 8 ranks, 2 x 8192, bf16, full AC, chunked loss."""
    cfg = load(
        None,
        [
            "model.preset=llama3-8b", "data.seq_len=8192", "train.micro_batch_size=2",
            "activations.mode=full", "precision.mode=bf16",
        ],
    )  # fmt: skip
    planned = plan(cfg, world_size=8, device=parse_device("h100"))
    assert [u.name for u in planned.scenario.edges] == ["embedding", "norm", "head"]
    assert planned.memory.peak.bytes <= 22 * GiB
    # the head's reduce-scatter input (V x d fp32) is gone before any block's backward
    assert planned.memory.peak.breakdown["collective_buffers"] < 1.5 * GiB


@pytest.mark.parametrize("tied", [True, False])
def test_root_of_a_tied_model_still_holds_the_shared_weight(tied: bool) -> None:
    cfg = load(None, ["model.vocab_size=1001", f"model.tie_embeddings={str(tied).lower()}"])
    sc = plan(cfg, world_size=4).scenario
    assert sc.model is not None
    assert (sc.root.numel >= 1001 * sc.model.dim) is tied
    assert bool(sc.edges) is not tied


@pytest.mark.parametrize("edge_units", [True, False])
def test_doctor_counts_edge_units_apart_from_the_root(edge_units: bool) -> None:
    model = build(untied(TINY), meta=True)
    units = plan_units(choose_blocks(model).blocks, RunConfig())
    checks = {
        c.name: c for c in structure_checks(model, units, block_classes=[], edge_units=edge_units)
    }
    share = checks["params outside blocks"].message
    assert ("in the untied embedding and head's own units" in share) is edge_units
    assert checks["dtypes"].status == "ok"
