"""``fsdpkit train`` with tensor and context parallelism, as a user runs it: a
checkpoint saved at dp2 x tp2 resumes at dp4, tp4 and dp2 x cp2 (ring attention) with the same next
losses, at its own layout bit for bit; HF exports of a tp run and of an FSDP-only run
hold the same tensors; a layout the model or the world cannot take is one paragraph
naming the field, before any worker starts."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from clirun import fsdpkit, losses
from safetensors.torch import load_file

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

COMMON = [
    "--nproc",
    "4",
    "train.steps=6",
    "model.n_layers=2",
    "model.dim=64",
    "model.n_heads=4",
    "model.n_kv_heads=4",
    "model.ffn_dim=96",
    "data.seq_len=32",
    "data.max_bytes=400000",
    "train.global_batch_size=8",
    "train.warmup_steps=2",
    "train.eval_every=0",
    "train.sample_tokens=0",
    "logging.report=false",
    "checkpoint.every=3",
]
RESUMED = {
    "dp4": "parallel.tp=1",
    "tp4": "parallel.tp=4",
    "dp2xcp2-ring": "parallel.cp=2 parallel.cp_attention=ring",
}
"""Layouts the dp2 x tp2 checkpoint resumes at (cp through torch's ring attention; the
Ulysses exchange's parity is tests/distributed/test_model_parallel.py's)."""


def _train(tmp: Path, name: str, *extra: str) -> subprocess.CompletedProcess[str]:
    run = fsdpkit("train", *COMMON, f"logging.run_dir={tmp / name}", *extra, cwd=tmp, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("mp")
    first = _train(tmp, "tp2", "parallel.tp=2")
    assert "tensor parallel 2" in first.stdout
    ckpt = tmp / "tp2" / "checkpoints" / "step-00000003"
    for name, layout in [*RESUMED.items(), ("same", "parallel.tp=2")]:
        run = _train(tmp, name, *layout.split(), f"checkpoint.resume={ckpt}")
        assert ("ring attention" in run.stdout) == name.endswith("-ring"), run.stdout[:3000]
    return tmp


@pytest.mark.parametrize("name", list(RESUMED))
def test_resume_at_another_layout_continues_the_same_losses(runs: Path, name: str) -> None:
    original = losses(runs / "tp2")[3:]
    resumed = losses(runs / name)
    assert len(resumed) == 3
    for step, (a, b) in enumerate(zip(resumed, original, strict=True), start=4):
        assert abs(a - b) <= 1e-6 * abs(b), f"{name}: step {step} loss {a} vs {b}"


def test_resume_at_the_same_layout_is_bit_exact(runs: Path) -> None:
    assert losses(runs / "same") == losses(runs / "tp2")[3:]


def test_hf_export_of_a_tp_run_equals_the_fsdp_only_one(runs: Path) -> None:
    out = {}
    for name in ("tp2", "dp4"):
        ckpt = runs / name / "checkpoints" / "step-00000006"
        done = fsdpkit(
            "ckpt", "export", str(ckpt), "--format", "hf", str(runs / f"hf-{name}"), cwd=runs
        )
        assert done.returncode == 0, done.stderr[-2000:]
        out[name] = load_file(str(runs / f"hf-{name}" / "model-00001-of-00001.safetensors"))
    assert out["tp2"].keys() == out["dp4"].keys()
    for key, value in out["dp4"].items():
        assert out["tp2"][key].dtype == value.dtype and out["tp2"][key].shape == value.shape
        torch.testing.assert_close(out["tp2"][key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("parallel.tp=3", "parallel.tp x parallel.cp = 3 x 1"),
        (
            "model.n_kv_heads=2 parallel.tp=4",
            "parallel.tp = 4 does not divide the model's 2 key/value heads",
        ),
        ("parallel.cp=2 data.seq_len=33", "must divide data.seq_len = 33"),
        ("parallel.cp=4 model.n_heads=2 model.n_kv_heads=2", "parallel.cp = 4"),
        ("parallel.cp=2 parallel.cp_attention=ring data.seq_len=34", "multiple of 2 x parallel.cp"),
    ],
)
def test_bad_layout_is_one_paragraph_before_any_worker(
    tmp_path: Path, override: str, field: str
) -> None:
    run = fsdpkit(
        "train", *COMMON, f"logging.run_dir={tmp_path / 'bad'}", *override.split(), cwd=tmp_path
    )
    assert run.returncode != 0
    assert field in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


def test_lora_sft_at_tp2_exports_the_adapters_an_fsdp_only_run_does(tmp_path: Path) -> None:
    """LoRA SFT on a transformers Llama (packed chat rows, adapters only): tp2 and dp2
    runs of 3 steps export the same peft adapter tensors."""
    from tiny_hf import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "tiny-chat", arch="llama", dim=32, chat=True)
    sft = Path(__file__).parents[2] / "examples" / "sft_tiny.jsonl"
    adapters = {}
    for name, layout in (("tp2", "parallel.tp=2"), ("dp2", "parallel.tp=1")):
        run = fsdpkit(
            "train",
            "--nproc",
            "2",
            f"model.hf={model_dir}",
            f"data.path={sft}",
            "lora.rank=4",
            "checkpoint.adapters_only=true",
            "checkpoint.every=3",
            "data.seq_len=128",
            "train.steps=3",
            "train.global_batch_size=4",
            "train.micro_batch_size=2",
            "logging.report=false",
            f"logging.run_dir={tmp_path / name}",
            layout,
            cwd=tmp_path,
            env={"HF_HUB_OFFLINE": "1"},
            timeout=400,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        ckpt = tmp_path / name / "checkpoints" / "step-00000003"
        out = tmp_path / f"adapter-{name}"
        done = fsdpkit("ckpt", "export", str(ckpt), "--format", "peft", str(out), cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        adapters[name] = load_file(str(out / "adapter_model.safetensors"))
    assert adapters["tp2"].keys() == adapters["dp2"].keys()
    assert any("lora_B" in key for key in adapters["dp2"])
    for key, value in adapters["dp2"].items():
        torch.testing.assert_close(adapters["tp2"][key], value, rtol=1e-5, atol=1e-6, msg=key)
