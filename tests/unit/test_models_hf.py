"""Bringing your own model, without a process group: factory outputs, meta buffers,
``model.hf`` directories and their errors, the NaN guard."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fsdpkit.config import ConfigError, ModelConfig, from_dict
from fsdpkit.data.batch import IGNORE_INDEX
from fsdpkit.loss.contract import ModelOutputError, logits_of, next_token_loss
from fsdpkit.models.buffers import UninitializedBufferError, meta_params, require_buffer_source
from fsdpkit.models.errors import ModelError
from fsdpkit.models.factory import build_model
from fsdpkit.sharding.materialize import materialize
from fsdpkit.train.guards import NonFiniteLossError, check_finite
from meta_models import PositionalMLP, positional_mlp_cpu

CPU = torch.device("cpu")
IDS = torch.zeros(2, 5, dtype=torch.long)
LOGITS = torch.randn(2, 5, 7)


@pytest.mark.parametrize(
    "output",
    [LOGITS, {"logits": LOGITS}, (LOGITS, torch.tensor(1.0)), SimpleNamespace(logits=LOGITS)],
)
def test_logits_are_found_in_any_output(output: object) -> None:
    assert logits_of(output, tokens=IDS) is LOGITS


def test_output_without_logits_is_one_clear_paragraph() -> None:
    with pytest.raises(ModelOutputError, match=r"returned Tensor with shape \(\)") as err:
        logits_of(torch.tensor(3.0), tokens=IDS)
    assert "(module, loss_fn)" in str(err.value) and "docs/models.md" in str(err.value)
    with pytest.raises(ModelOutputError, match="returned str"):
        logits_of("nope", tokens=IDS)


def test_next_token_loss_shifts_once_and_skips_ignored_labels() -> None:
    class Successor(nn.Module):  # a perfect next-token model for "each token is input + 1"
        def forward(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"logits": 50.0 * nn.functional.one_hot((tokens + 1) % 7, 7).float()}

    assert next_token_loss(Successor(), torch.tensor([[0, 1, 2, 3, 4]])) < 1e-6
    assert next_token_loss(Successor(), torch.tensor([[0, 1, 2, 3, 6]])) > 10
    assert next_token_loss(Successor(), torch.tensor([[0, 1, 2, 3, IGNORE_INDEX]])) < 1e-6


def test_meta_params_keeps_constructor_buffers_and_materialize_keeps_them() -> None:
    with meta_params():
        model = PositionalMLP()
    assert all(p.is_meta for p in model.parameters())
    expected = PositionalMLP().positions
    assert torch.equal(model.positions, expected)
    materialize(model, seed=0, param_device=CPU, buffer_device=CPU)
    assert torch.equal(model.positions, expected)
    for name, p in positional_mlp_cpu().named_parameters():  # fsdpkit's per-parameter init
        assert torch.equal(model.get_parameter(name), p), name


def test_meta_buffers_without_a_source_are_refused_by_name() -> None:
    with torch.device("meta"):
        model = PositionalMLP()
    with pytest.raises(UninitializedBufferError, match="positions") as err:
        require_buffer_source(model)
    assert "fsdpkit.meta_params()" in str(err.value) and "init_buffers" in str(err.value)
    spec = ModelConfig(factory="meta_models:positional_mlp_bare_meta")
    built = build_model(spec, vocab_size=256, seq_len=16, seed=0)  # builds; the run refuses
    with pytest.raises(UninitializedBufferError, match="positions"):
        require_buffer_source(built.module)
    # and materialize itself never lets one through (fsdpkit.shard on a library user's model)
    with pytest.raises(UninitializedBufferError, match="after materialization"):
        materialize(model, seed=0, param_device=CPU, buffer_device=CPU)


def test_meta_built_hf_model_gets_its_buffers_from_its_own_init() -> None:
    transformers = pytest.importorskip("transformers")
    from tiny_hf import tiny_config

    from fsdpkit.models.hf.initialize import recreate_hf_buffers

    for arch in ("llama", "gemma"):
        cfg = tiny_config(arch, vocab_size=64, dim=32)
        reference = dict(transformers.AutoModelForCausalLM.from_config(cfg).named_buffers())
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        assert recreate_hf_buffers(model, seed=0) == []
        got = dict(model.named_buffers())
        assert got.keys() == reference.keys()
        for name, value in reference.items():
            assert torch.equal(got[name], value), (arch, name)


def test_model_hf_config_conflicts_name_the_keys() -> None:
    with pytest.raises(ConfigError, match=r"model\.hf and model\.factory"):
        from_dict({"model": {"hf": "d", "factory": "a:b"}})
    with pytest.raises(ConfigError, match=r"model.n_layers .*config.json"):
        from_dict({"model": {"hf": "d", "n_layers": 2}})
    assert from_dict({"model": {"hf": "d"}}).model.hf == "d"


def test_model_hf_directory_errors(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tiny_hf import write_tiny_model

    from fsdpkit.models.hf.directory import check_inputs, read_hf_dir

    with pytest.raises(ModelError, match="does not exist"):
        read_hf_dir(tmp_path / "missing")
    with pytest.raises(ModelError, match=r"has no config\.json"):
        read_hf_dir(tmp_path)
    d = write_tiny_model(tmp_path / "m", arch="llama", vocab_size=64, dim=32, tokenizer=False)
    (d / "pytorch_model.bin").write_bytes(b"")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelError, match=r"pickled weights .*save_pretrained"):
        read_hf_dir(d)
    (d / "pytorch_model.bin").unlink()
    source = read_hf_dir(d)
    assert not source.has_weights and source.tokenizer is None
    with pytest.raises(ModelError, match="vocab_size 64"):
        check_inputs(source, vocab_size=256, seq_len=16)
    with pytest.raises(ModelError, match=r"data\.seq_len = 1024 .*\(512 positions"):
        check_inputs(source, vocab_size=64, seq_len=1024)
    (d / "config.json").write_text('{"model_type": "not-a-model"}')
    with pytest.raises(ModelError, match="trust_remote_code"):
        read_hf_dir(d)


def test_non_finite_loss_or_norm_stops_with_step_and_checkpoint(tmp_path: Path) -> None:
    check_finite(loss=1.0, grad_norm=2.0, step=4, scaled=False)
    check_finite(loss=1.0, grad_norm=float("inf"), step=4, scaled=True)  # the scaler skips it
    ckpt = SimpleNamespace(last_step=2, root=tmp_path, wait=lambda: None)
    with pytest.raises(NonFiniteLossError, match="step 5: loss nan") as err:
        check_finite(loss=float("nan"), grad_norm=1.0, step=5, scaled=False, checkpointer=ckpt)
    assert str(tmp_path / "step-00000002") in str(err.value)
    with pytest.raises(NonFiniteLossError, match=r"gradient norm inf.*No checkpoint"):
        check_finite(loss=1.0, grad_norm=float("inf"), step=1, scaled=False)


def test_doctor_sees_model_hf_and_meta_params_buffers_as_kept(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tiny_hf import write_tiny_model

    from fsdpkit.config import RunConfig
    from fsdpkit.doctor.diagnose import model_checks

    d = write_tiny_model(tmp_path / "m", arch="llama", dim=32)  # vocab 320 > bytes: its tokenizer
    for model in (ModelConfig(hf=str(d)), ModelConfig(factory="meta_models:positional_mlp_meta")):
        checks, _ = model_checks(RunConfig(model=model), world_size=2, trace=False)
        by = {c.name: c for c in checks}
        assert by["model build"].status == "ok", by["model build"].message
        assert by["meta buffers"].status == "ok" and "constructor" in by["meta buffers"].message
        if model.hf:
            assert "declared by the model (_no_split_modules)" in by["model build"].message
