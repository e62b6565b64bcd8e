"""Quantized model directories are refused by name ([Note: quantized checkpoints]):
``model.hf``, ``model.init_from`` and the planner, for every ``quantization_config``
shape transformers writes (bitsandbytes 4/8-bit, GPTQ, AWQ, fp8, compressed-tensors)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdpkit.checkpoint.hf_weights import load_hf_weights
from fsdpkit.checkpoint.quantized import QuantizedCheckpointError
from fsdpkit.config import ModelConfig, load
from fsdpkit.errors import UserError
from fsdpkit.models.factory import build_model
from fsdpkit.models.llama import Llama, preset
from fsdpkit.planner import PlanError, plan

pytest.importorskip("transformers")
from tiny_hf import write_tiny_model

KINDS = {
    "bnb-4bit": (
        {
            "quant_method": "bitsandbytes",
            "load_in_4bit": True,
            "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_compute_dtype": "bfloat16",
        },
        "'bitsandbytes' (4-bit, nf4)",
    ),
    "bnb-8bit-legacy": ({"load_in_8bit": True}, "'bitsandbytes' (8-bit)"),
    "gptq": (
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False},
        "'gptq' (4-bit)",
    ),
    "awq": ({"quant_method": "awq", "bits": 4, "version": "gemm"}, "'awq' (4-bit)"),
    "fp8": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}, "'fp8'"),
    "compressed-tensors": (
        {"quant_method": "compressed-tensors", "format": "pack-quantized"},
        "'compressed-tensors'",
    ),
}


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("plain") / "m")


def _quantized(plain: Path, tmp_path: Path, quant: dict[str, object]) -> Path:
    out = tmp_path / "quantized"
    out.mkdir()
    for file in plain.iterdir():
        (out / file.name).write_bytes(file.read_bytes())
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quant
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_model_hf_refuses_each_kind_by_name(plain: Path, tmp_path: Path, kind: str) -> None:
    quant, named = KINDS[kind]
    directory = _quantized(plain, tmp_path, quant)
    with pytest.raises(QuantizedCheckpointError) as err:
        build_model(ModelConfig(hf=str(directory)), vocab_size=64, seq_len=16, seed=0)
    message = str(err.value)
    assert f"model.hf = {str(directory)!r} is a quantized checkpoint" in message
    assert named in message and "original bf16/fp16 checkpoint" in message


@pytest.mark.parametrize("kind", ["gptq", "bnb-4bit"])
def test_planner_refuses_a_quantized_model_hf(plain: Path, tmp_path: Path, kind: str) -> None:
    directory = _quantized(plain, tmp_path, KINDS[kind][0])
    with pytest.raises(PlanError, match="is a quantized checkpoint"):
        plan(load(None, [f"model.hf={directory}"]), world_size=2)


def test_init_from_refuses_a_quantized_directory_before_reading(
    plain: Path, tmp_path: Path
) -> None:
    directory = _quantized(plain, tmp_path, KINDS["awq"][0])
    model = Llama(preset("tiny", vocab_size=64, max_seq_len=16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(QuantizedCheckpointError, match=r"model.init_from = .* 'awq'"):
        load_hf_weights(model, directory)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_plain_directory_is_accepted(plain: Path) -> None:
    built = build_model(ModelConfig(hf=str(plain)), vocab_size=64, seq_len=16, seed=0)
    assert built.hf is not None


def test_plan_cli_exits_2_with_one_paragraph(plain: Path, tmp_path: Path) -> None:
    directory = _quantized(plain, tmp_path, KINDS["fp8"][0])
    result = subprocess.run(
        [sys.executable, "-m", "fsdpkit", "plan", f"model.hf={directory}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result
    assert "is a quantized checkpoint" in result.stderr and "Traceback" not in result.stderr
    assert isinstance(QuantizedCheckpointError("x"), UserError)
