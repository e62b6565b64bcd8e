"""``fsdpkit train`` of the built-in MoE model with expert parallelism, as a user runs
it: ep 2 on 4 ranks says its layout and router loss in its first lines, logs the
router's metrics, and its checkpoint resumes at ep 1 with the same next losses; the
HF export loads in transformers' Qwen3-MoE with the trained logits; a capacity factor
counts its dropped assignments; a layout the model or the world cannot take is one
paragraph naming the field, before any worker starts."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from clirun import fsdpkit, losses

pytestmark = pytest.mark.e2e

COMMON = [
    "--nproc",
    "4",
    "model.preset=moe-tiny",
    "model.n_layers=2",
    "data.seq_len=32",
    "data.max_bytes=200000",
    "train.global_batch_size=8",
    "train.steps=4",
    "train.warmup_steps=2",
    "train.eval_every=0",
    "train.sample_tokens=0",
    "logging.report=false",
]


def _train(tmp: Path, name: str, *extra: str) -> subprocess.CompletedProcess[str]:
    run = fsdpkit("train", *COMMON, f"logging.run_dir={tmp / name}", *extra, cwd=tmp, timeout=500)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def _metrics(run: Path) -> list[dict[str, object]]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


@pytest.mark.slow
def test_ep2_trains_resumes_at_ep1_and_exports_qwen3_moe(tmp_path: Path) -> None:
    first = _train(tmp_path, "ep2", "parallel.ep=2", "checkpoint.every=2")
    assert "expert parallel 2 (2 of 4 experts per rank)" in first.stdout, first.stdout[:3000]
    assert "router load-balancing loss x 0.01 added to the loss" in first.stdout
    last = _metrics(tmp_path / "ep2")[-1]
    assert float(last["aux_loss"]) > 0 and len(last["expert_load_max_by_layer"]) == 2  # type: ignore[arg-type]
    ckpt = tmp_path / "ep2" / "checkpoints" / "step-00000002"
    _train(tmp_path, "ep1", f"checkpoint.resume={ckpt}")
    original, resumed = losses(tmp_path / "ep2")[2:], losses(tmp_path / "ep1")
    assert len(resumed) == 2
    for a, b in zip(resumed, original, strict=True):
        assert abs(a - b) <= 1e-6 * abs(b), (resumed, original)
    _export_loads_in_transformers(tmp_path / "ep2" / "checkpoints" / "step-00000004", tmp_path)


def _export_loads_in_transformers(ckpt: Path, tmp: Path) -> None:
    """The HF export (save_pretrained's per-expert layout) and the torch export (the
    model's own names) give the same logits, through Qwen3MoeForCausalLM and the
    built-in model."""
    import transformers

    from fsdpkit.models.moe import MoE, MoEConfig

    for fmt in ("hf", "torch"):
        done = fsdpkit("ckpt", "export", str(ckpt), str(tmp / fmt), "--format", fmt, cwd=tmp)
        assert done.returncode == 0, done.stderr[-2000:]
    files = sorted(p.name for p in (tmp / "hf").iterdir())
    index = json.loads((tmp / "hf" / "model.safetensors.index.json").read_text())
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in index["weight_map"], files
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp / "hf", dtype=torch.float32)
    state = torch.load(tmp / "torch", weights_only=True)  # a file: the target did not exist
    config = theirs.config
    ours = MoE(
        MoEConfig(
            vocab_size=config.vocab_size, dim=config.hidden_size, n_layers=2, n_heads=4,
            n_kv_heads=2, ffn_dim=config.intermediate_size, n_experts=4, top_k=2,
            moe_ffn_dim=config.moe_intermediate_size, max_seq_len=config.max_position_embeddings,
        )
    )  # fmt: skip
    ours.load_state_dict(state, strict=True)
    probe = torch.arange(2 * 12).reshape(2, 12) * 7 % config.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(theirs(probe).logits, ours(probe), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_capacity_factor_counts_dropped_assignments(tmp_path: Path) -> None:
    run = _train(tmp_path, "cap", "parallel.ep=2", "model.capacity_factor=0.5", "train.steps=2")
    assert "capacity factor 0.5: assignments past an expert's capacity" in run.stdout
    rows = _metrics(tmp_path / "cap")
    assert all(0.4 < float(r["moe_dropped"]) < 0.6 for r in rows), rows  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("parallel.ep=3", "parallel.ep = 3 does not divide the shard group (4 ranks"),
        ("parallel.ep=8", "parallel.ep = 8 does not divide the shard group"),
        ("model.experts=6 parallel.ep=4", "parallel.ep = 4 does not divide the 6 routed experts"),
        (
            "model.preset=tiny parallel.ep=2",
            "parallel.ep is set but model.preset = tiny is a dense",
        ),
    ],
)
def test_bad_expert_layout_is_one_paragraph_before_any_worker(
    tmp_path: Path, override: str, field: str
) -> None:
    run = fsdpkit(
        "train", *COMMON, f"logging.run_dir={tmp_path / 'bad'}", *override.split(), cwd=tmp_path
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert field in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()
