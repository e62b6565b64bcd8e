"""``model.hf``: five architectures, on 2 gloo ranks, against transformers in one process.

One spawn runs every architecture (process start-up dominates): build on meta from a
saved directory, shard, read each rank's slices; logits against ``from_pretrained``;
10 training steps against the unsharded ``from_pretrained`` model on the same global
batch; a DCP checkpoint exported with ``fsdpkit.export.offline`` and loaded back
with ``from_pretrained``. A bare config.json (GPT-2: Conv1D, tied, scaled residual init)
initializes identically sharded and unsharded, with the model's own init.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdpkit import build_mesh, shard
from fsdpkit.config import CheckpointConfig, ModelConfig, RunConfig
from fsdpkit.loss.contract import next_token_loss
from fsdpkit.models.factory import build_model
from fsdpkit.testing import run_ranks
from support import eval_logits, full_state, global_batches, train

pytestmark = pytest.mark.distributed
transformers = pytest.importorskip("transformers")

ARCHS = ("llama", "qwen3", "mistral", "gemma", "gpt2")
STEPS = 10
VOCAB = 256


def _build(model_dir: str) -> Any:
    return build_model(ModelConfig(hf=model_dir), vocab_size=VOCAB, seq_len=16, seed=3)


def _one_arch(rank: int, model_dir: str, run_dir: str) -> dict[str, Any]:
    from fsdpkit.checkpoint import Checkpointer, ModelOptimizerState

    built = _build(model_dir)
    cfg = RunConfig(model=ModelConfig(hf=model_dir))  # blocks: the model's _no_split_modules
    model = built.module
    plan = shard(model, cfg, mesh=build_mesh(), init=built.init)
    out: dict[str, Any] = {"plan": plan.describe(), "loaded": eval_logits(model)}
    emb = model.get_input_embeddings().weight
    out["tied"] = model.get_output_embeddings().weight is emb
    batches = global_batches(STEPS, vocab=VOCAB)
    result = train(model, batches, rank=rank, world=2, loss_fn=next_token_loss)
    out["loss"] = result["loss"]
    out["trained"] = eval_logits(model)
    out["still_tied"] = model.get_output_embeddings().weight is emb
    meta = {"config": cfg.to_dict()}
    ckpt = Checkpointer(run_dir=Path(run_dir), cfg=CheckpointConfig(every=1), run_meta=meta)
    ckpt.save(STEPS, {"app": ModelOptimizerState(model, None)})
    return out


def _all_archs(rank: int, world: int, dirs: dict[str, str], runs: dict[str, str]) -> Any:
    out = {arch: _one_arch(rank, dirs[arch], runs[arch]) for arch in ARCHS}
    built = _build(dirs["gpt2-config"])
    shard(built.module, RunConfig(), mesh=build_mesh(), init=built.init)
    out["config-only"] = full_state(built.module)
    return out


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tiny_hf import write_tiny_model

    os.environ["HF_HUB_OFFLINE"] = "1"
    tmp = tmp_path_factory.mktemp("hf")
    dirs = {
        a: str(write_tiny_model(tmp / a, arch=a, vocab_size=VOCAB, dim=32, tokenizer=False))
        for a in ARCHS
    }
    dirs["gpt2-config"] = str(
        write_tiny_model(tmp / "cfg", arch="gpt2", vocab_size=VOCAB, weights=False, tokenizer=False)
    )
    runs = {a: str(tmp / f"run-{a}") for a in ARCHS}
    results = run_ranks(_all_archs, world_size=2, args=(dirs, runs), timeout_s=400)
    return {"tmp": tmp, "dirs": dirs, "runs": runs, "ranks": results}


def _reference(model_dir: str) -> tuple[torch.Tensor, list[float]]:
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loaded = eval_logits(ref)
    return loaded, train(ref, global_batches(STEPS, vocab=VOCAB), loss_fn=next_token_loss)["loss"]


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_model_loads_trains_and_exports(hf_runs: dict[str, Any], arch: str) -> None:
    from fsdpkit.export import export

    loaded, losses = _reference(hf_runs["dirs"][arch])
    for rank in hf_runs["ranks"]:
        got = rank[arch]
        assert got["plan"].startswith("2 x "), got["plan"]  # one unit per _no_split_modules block
        torch.testing.assert_close(got["loaded"], loaded, rtol=0, atol=1e-5)
        torch.testing.assert_close(got["loss"], losses, rtol=1e-5, atol=0)
        assert got["tied"] == got["still_tied"]
    assert hf_runs["ranks"][0][arch]["tied"] == (arch in ("gemma", "gpt2"))
    out = hf_runs["tmp"] / f"export-{arch}"
    export(Path(hf_runs["runs"][arch]) / "checkpoints" / "step-00000010", out, fmt="hf")
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    trained = hf_runs["ranks"][0][arch]["trained"]
    torch.testing.assert_close(eval_logits(back), trained, rtol=0, atol=1e-5)
    assert (out / "generation_config.json").is_file()


def test_config_only_init_is_the_models_own_and_world_size_independent(
    hf_runs: dict[str, Any],
) -> None:
    from fsdpkit.sharding.materialize import materialize

    built = _build(hf_runs["dirs"]["gpt2-config"])
    assert built.init is not None

    def init(model: torch.nn.Module) -> None:
        model.tie_weights()  # type: ignore[operator]  # to_empty of a plain module unties
        built.init(model)

    cpu = torch.device("cpu")
    materialize(built.module, seed=3, param_device=cpu, buffer_device=cpu, init=init)
    unsharded = full_state(built.module)
    assert set(unsharded) == set(hf_runs["ranks"][0]["config-only"])
    for rank in hf_runs["ranks"]:
        for name, value in unsharded.items():
            assert torch.equal(rank["config-only"][name], value), name
    # GPT-2's own init: N(0, 0.02) embeddings, c_proj scaled by 1/sqrt(2 * n_layer),
    # LayerNorm ones, zero biases (fsdpkit's default would be uniform and unscaled).
    std = 0.02
    assert abs(unsharded["transformer.wte.weight"].std() - std) < 0.1 * std
    scaled = unsharded["transformer.h.0.mlp.c_proj.weight"].std()
    assert abs(scaled - std / 2) < 0.1 * std / 2, scaled
    ln = unsharded["transformer.h.1.ln_1.weight"]
    assert torch.equal(ln, torch.ones_like(ln))
    assert not unsharded["transformer.h.0.attn.c_attn.bias"].any()
