"""Hugging Face models through the CLI, as a user runs them: a directory written by
``examples/make_tiny_hf_model.py`` trained with ``fsdpkit train model.hf=DIR``, exported
with ``fsdpkit ckpt export --format hf`` and loaded back by ``from_pretrained``; a NaN on
one rank stops the run with a named error and the previous checkpoint intact."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from clirun import fsdpkit, losses

from fsdpkit.export import export

pytestmark = pytest.mark.e2e
transformers = pytest.importorskip("transformers")

REPO = Path(__file__).parents[2]
OFFLINE = {"HF_HUB_OFFLINE": "1"}
SHORT = [
    "train.steps=12",
    "train.eval_every=6",
    "train.sample_tokens=0",
    "data.max_bytes=200000",
    "data.seq_len=64",
    "checkpoint.every=6",
    "checkpoint.resume=never",
]


def test_train_model_hf_dir_then_export_loads_in_transformers(tmp_path: Path) -> None:
    model_dir = tmp_path / "tiny-qwen3"
    script = REPO / "examples" / "make_tiny_hf_model.py"
    made = subprocess.run(
        [sys.executable, str(script), str(model_dir), "--arch", "qwen3", "--dim", "32"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr[-2000:]
    run = tmp_path / "run"
    result = fsdpkit(
        "train",
        f"model.hf={model_dir}",
        *SHORT,
        f"logging.run_dir={run}",
        cwd=tmp_path,
        env=OFFLINE,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Qwen3DecoderLayer units" in result.stdout
    curve = losses(run)
    assert len(curve) == 12 and curve[-1] < curve[0] - 0.1, curve  # 12 steps of warm-up
    config = (run / "config.toml").read_text()
    assert f'tokenizer = "{model_dir / "tokenizer.json"}"' in config  # the model's tokenizer

    ckpt = run / "checkpoints" / "step-00000012"
    out = tmp_path / "export"
    exported = fsdpkit("ckpt", "export", str(ckpt), "--format", "hf", str(out), cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr[-2000:]
    flat = export(ckpt, tmp_path / "flat.pt", fmt="torch")  # the trained weights, by name
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert back.dtype == torch.float32
    reference = transformers.AutoModelForCausalLM.from_config(back.config).eval()
    reference.load_state_dict(torch.load(flat, weights_only=True), strict=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tokenizer("def main():\n    return 0\n")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)
    assert (out / "generation_config.json").is_file()


def test_nan_on_one_rank_stops_with_named_error_and_keeps_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    result = fsdpkit(
        "train",
        "model.factory=factories:gpt2_nan_on_rank1",  # HF ModelOutput; NaN on rank 1, step 3
        *SHORT,
        "train.eval_every=0",
        "checkpoint.every=2",
        f"logging.run_dir={run}",
        cwd=tmp_path,
        env=OFFLINE,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "training stopped at step 3: loss nan" in result.stderr
    assert "last good checkpoint is" in result.stderr and "step-00000002" in result.stderr
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-00000002"]
    verified = fsdpkit("ckpt", "verify", str(run / "checkpoints" / "step-00000002"), cwd=tmp_path)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert len(losses(run)) == 2


def test_meta_buffers_nothing_recreates_are_refused_before_training(tmp_path: Path) -> None:
    result = fsdpkit(
        "train",
        "model.factory=meta_models:positional_mlp_bare_meta",  # torch.device("meta"), no hook
        *SHORT,
        f"logging.run_dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "positions" in result.stderr and "fsdpkit.meta_params()" in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
