"""Mixture-of-experts ``model.hf`` directories: loaded as ``from_pretrained`` loads them,
trained with the router's loss, exported in ``save_pretrained``'s layout.

transformers keeps MoE checkpoints per expert and fuses them while loading ([Note: one
loading rule with transformers]). Two spawns of 2 gloo ranks:

- every causal-LM family that declares a weight conversion in the installed
  transformers (enumerated, not listed), as a shrunk random model written by
  ``save_pretrained``: fsdpkit's sharded state equals ``from_pretrained``'s bit for
  bit, and so does the first loss; the same at one process;
- Mixtral, Qwen3-MoE and OLMoE, 10 AdamW steps: the losses and grad norms of
  transformers' own loss with its aux loss (``output_router_logits=True``) in one
  process, within 1e-5; the export loads with ``from_pretrained`` and gives the
  trained logits.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdpkit import build_mesh, shard
from fsdpkit.config import CheckpointConfig, ModelConfig, RunConfig
from fsdpkit.loss.contract import next_token_loss
from fsdpkit.loss.router import with_router_loss
from fsdpkit.models.factory import build_model
from fsdpkit.testing import run_ranks
from support import eval_logits, full_state, global_batches, train

pytestmark = pytest.mark.distributed
transformers = pytest.importorskip("transformers")

TRAINED = ("mixtral", "qwen3_moe", "olmoe")
STEPS = 10
VOCAB = 256
AUX_COEF = 0.1
"""Larger than the families' defaults (0.001-0.01), so a wrong aux loss shows."""
MAX_PARAMS = 5_000_000
"""A shrunk family bigger than this kept a size key SHRINK does not know: skipped."""


def converting_families() -> list[str]:
    """Causal-LM model types with a weight conversion in the installed transformers."""
    from transformers.conversion_mapping import _build_checkpoint_conversion_mapping
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    mapping = _build_checkpoint_conversion_mapping()
    return sorted(k for k in mapping if k in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _write_family(model_type: str, out: Path) -> str | None:
    """A shrunk random model of ``model_type`` saved by save_pretrained; the reason
    when transformers itself cannot build, save, reload it exactly and run it (then
    skipped: the family's own code refuses the shrunk config)."""
    from tiny_hf import shrunk_config

    try:
        config = shrunk_config(model_type)
        with torch.device("meta"):
            meta = transformers.AutoModelForCausalLM.from_config(config)
        size = sum(p.numel() for p in meta.parameters())
        if size > MAX_PARAMS:
            return f"{size} parameters after shrinking"
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(out)
        back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        if any(not torch.equal(v, back.state_dict()[k]) for k, v in model.state_dict().items()):
            return "transformers' own save/load round trip is not exact"
        next_token_loss(back, _batch())  # the family's own forward on the shrunk shape
    except Exception as exc:  # the family's own code refuses the shrunk config
        return f"{type(exc).__name__}: {str(exc)[:120]}"
    return None


def _batch() -> torch.Tensor:
    return torch.arange(2 * 17).reshape(2, 17) * 7 % VOCAB


def _first_loss(model: torch.nn.Module) -> float:
    """The loss on ``_batch`` in eval mode (PhiMoE's router samples while training)."""
    model.eval()
    with torch.no_grad():
        return float(next_token_loss(model, _batch()))


def _load_all(rank: int, world: int, dirs: dict[str, str]) -> dict[str, Any]:
    out = {}
    for name, path in dirs.items():
        built = build_model(ModelConfig(hf=path), vocab_size=VOCAB, seq_len=16, seed=0)
        model = built.module
        shard(model, RunConfig(model=ModelConfig(hf=path)), mesh=build_mesh(), init=built.init)
        out[name] = {"state": full_state(model), "loss": _first_loss(model)}
    return out


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    os.environ["HF_HUB_OFFLINE"] = "1"
    transformers.logging.set_verbosity_error()
    tmp = tmp_path_factory.mktemp("families")
    dirs, skipped = {}, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type in converting_families():
            why = _write_family(model_type, tmp / model_type)
            if why is None:
                dirs[model_type] = str(tmp / model_type)
            else:
                skipped[model_type] = why
    ranks = run_ranks(_load_all, world_size=2, args=(dirs,), timeout_s=500)
    logging.getLogger(__name__).warning("families loaded %d, skipped %s", len(dirs), skipped)
    return {"dirs": dirs, "skipped": skipped, "ranks": ranks}


def _reference(path: str) -> tuple[dict[str, torch.Tensor], float]:
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return ref.state_dict(), _first_loss(ref)


def test_every_converting_family_loads_as_from_pretrained(families: dict[str, Any]) -> None:
    assert len(families["dirs"]) >= 30, families["skipped"]  # the enumeration still finds them
    for name, path in families["dirs"].items():
        want, loss = _reference(path)
        for rank in families["ranks"]:
            got = rank[name]
            params = {k: v for k, v in want.items() if k in got["state"]}
            assert len(params) == len(got["state"]), (name, set(got["state"]) - set(want))
            bad = [k for k, v in params.items() if not torch.equal(got["state"][k], v)]
            assert not bad, (name, bad[:3])
            assert got["loss"] == pytest.approx(loss, rel=1e-6, abs=0), name


def test_every_converting_family_loads_in_one_process(families: dict[str, Any]) -> None:
    from fsdpkit.models.hf.construct import HFWeights, construct
    from fsdpkit.models.hf.directory import read_hf_dir

    for name, path in families["dirs"].items():
        source = read_hf_dir(path)
        model = construct(source.config)
        model.to_empty(device="cpu")
        model.tie_weights()  # type: ignore[operator]  # to_empty of a plain module unties
        HFWeights(source, seed=0)(model)
        want, _ = _reference(path)
        got = model.state_dict()
        assert not [k for k, v in want.items() if not torch.equal(got[k], v)], name


def _hf_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' own objective: its CE on the next tokens plus coef x aux loss."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:].contiguous()
    out = model(input_ids=inputs, labels=inputs, shift_labels=targets, output_router_logits=True)
    return out.loss


def _train_one(rank: int, path: str, run_dir: str) -> dict[str, Any]:
    from fsdpkit.checkpoint import Checkpointer, ModelOptimizerState

    cfg = RunConfig(model=ModelConfig(hf=path))
    built = build_model(cfg.model, vocab_size=VOCAB, seq_len=16, seed=0)
    model = built.module
    shard(model, cfg, mesh=build_mesh(), init=built.init)
    loss_fn = with_router_loss(next_token_loss, model=model, coef=None)
    result = train(model, global_batches(STEPS, vocab=VOCAB), rank=rank, world=2, loss_fn=loss_fn)
    ckpt = Checkpointer(
        run_dir=Path(run_dir), cfg=CheckpointConfig(every=1), run_meta={"config": cfg.to_dict()}
    )
    ckpt.save(STEPS, {"app": ModelOptimizerState(model, None)})
    return {**result, "trained": eval_logits(model), "metrics": loss_fn.step_metrics()}


def _train_all(rank: int, world: int, dirs: dict[str, str], runs: dict[str, str]) -> Any:
    return {arch: _train_one(rank, dirs[arch], runs[arch]) for arch in TRAINED}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tiny_hf import write_tiny_model

    os.environ["HF_HUB_OFFLINE"] = "1"
    tmp = tmp_path_factory.mktemp("moe")
    dirs = {}
    for arch in TRAINED:
        out = write_tiny_model(tmp / arch, arch=arch, vocab_size=VOCAB, dim=32, tokenizer=False)
        config = json.loads((out / "config.json").read_text())
        config["router_aux_loss_coef"] = AUX_COEF
        (out / "config.json").write_text(json.dumps(config))
        dirs[arch] = str(out)
    runs = {a: str(tmp / f"run-{a}") for a in TRAINED}
    ranks = run_ranks(_train_all, world_size=2, args=(dirs, runs), timeout_s=400)
    return {"tmp": tmp, "dirs": dirs, "runs": runs, "ranks": ranks}


@pytest.mark.parametrize("arch", TRAINED)
def test_moe_training_matches_transformers_loss_with_aux(
    trained: dict[str, Any], arch: str
) -> None:
    from fsdpkit.export import export

    ref = transformers.AutoModelForCausalLM.from_pretrained(
        trained["dirs"][arch], dtype=torch.float32
    )
    want = train(ref, global_batches(STEPS, vocab=VOCAB), loss_fn=_hf_loss)
    plain = transformers.AutoModelForCausalLM.from_pretrained(
        trained["dirs"][arch], dtype=torch.float32
    )
    without = train(plain, global_batches(STEPS, vocab=VOCAB), loss_fn=next_token_loss)
    for rank in trained["ranks"]:
        got = rank[arch]
        torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-5, atol=0)
        torch.testing.assert_close(got["norm"], want["norm"], rtol=1e-5, atol=0)
        assert got["metrics"]["aux_loss"] > 0
    assert abs(without["loss"][0] - want["loss"][0]) > 1e-3  # the aux loss takes part
    out = trained["tmp"] / f"export-{arch}"
    export(Path(trained["runs"][arch]) / "checkpoints" / "step-00000010", out, fmt="hf")
    with tempfile.TemporaryDirectory() as layout:  # save_pretrained's own names
        ref.save_pretrained(layout)
        expected = set(
            json.loads(
                (Path(layout) / "model.safetensors.index.json").read_text()
                if (Path(layout) / "model.safetensors.index.json").exists()
                else "{}"
            ).get("weight_map", {})
        )
    names = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    if expected:
        assert names == expected
    assert any(".experts.0." in n for n in names), sorted(names)[:5]  # per expert, as on disk
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.testing.assert_close(
        eval_logits(back), trained["ranks"][0][arch]["trained"], rtol=0, atol=1e-5
    )
