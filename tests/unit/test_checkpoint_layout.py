"""Layout, verify, HF config mapping, and the Checkpointer without a process group (a
single-process user script)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fsdpkit.checkpoint import (
    Checkpointer,
    CheckpointError,
    ModelOptimizerState,
    list_entries,
    verify,
)
from fsdpkit.checkpoint.stepdir import META_FILE, crc32_file
from fsdpkit.config import CheckpointConfig, RunConfig
from fsdpkit.export import hf_config, llama_config
from fsdpkit.models.llama import Llama, LlamaConfig, preset

SMALL = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)


def _fake_ckpt(root: Path, step: int, files: dict[str, bytes], *, marker: bool = True) -> Path:
    path = root / "checkpoints" / f"step-{step:08d}"
    path.mkdir(parents=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    if marker:
        records = {n: {"bytes": len(d), "crc32": crc32_file(path / n)} for n, d in files.items()}
        meta = {"format": "fsdpkit-checkpoint", "version": 1, "step": step, "files": records}
        meta["world_size"] = 1
        (path / META_FILE).write_text(json.dumps(meta))
    return path


def test_listing_marks_complete_and_partial(tmp_path: Path) -> None:
    _fake_ckpt(tmp_path, 10, {".metadata": b"m", "__0_0.distcp": b"abc"})
    _fake_ckpt(tmp_path, 20, {".metadata": b"m"}, marker=False)
    (tmp_path / "checkpoints" / "step-00000030.tmp").mkdir()
    (tmp_path / "checkpoints" / "notes.txt").write_text("ignored")
    got = [(e.step, e.complete, e.path.name) for e in list_entries(tmp_path)]
    assert got == [
        (10, True, "step-00000010"),
        (20, False, "step-00000020"),
        (30, False, "step-00000030.tmp"),
    ]
    assert list_entries(tmp_path / "missing") == []


def test_verify_names_missing_truncated_and_corrupt_files(tmp_path: Path) -> None:
    files = {".metadata": b"meta", "__0_0.distcp": b"a" * 100, "__1_0.distcp": b"b" * 100}
    files["__2_0.distcp"] = b"c" * 10
    path = _fake_ckpt(tmp_path, 5, files)
    assert verify(path).ok
    (path / "__0_0.distcp").write_bytes(b"a" * 50)
    (path / "__1_0.distcp").write_bytes(b"b" * 99 + b"X")
    (path / "__2_0.distcp").unlink()
    report = verify(path)
    text = " | ".join(report.problems)
    assert "__0_0.distcp is truncated (50 of 100 bytes)" in text
    assert "__1_0.distcp is corrupt" in text
    assert "__2_0.distcp is missing" in text
    assert verify(path, checksums=False).problems != []
    (path / META_FILE).unlink()
    assert "fsdpkit.json is missing" in verify(path).describe()


def test_llama_config_from_preset_overrides_and_shapes() -> None:
    run = {"config": RunConfig().to_dict()}
    run["config"]["model"] |= {"preset": "llama3-1b", "n_layers": 2, "vocab_size": None}
    shapes = {
        "model.embed_tokens.weight": torch.Size([300, 2048]),
        "model.layers.0.mlp.gate_proj.weight": torch.Size([8192, 2048]),
        "model.layers.0.self_attn.k_proj.weight": torch.Size([512, 2048]),
        "model.layers.1.mlp.gate_proj.weight": torch.Size([8192, 2048]),
    }
    cfg = llama_config(run, shapes)
    assert cfg == preset("llama3-1b", n_layers=2, vocab_size=300)  # vocab from the tensors
    hf = hf_config(cfg, dtype=torch.bfloat16)
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["model_type"] == "llama"
    assert hf["rope_theta"] == 500000.0 and hf["tie_word_embeddings"] is True
    assert (hf["num_hidden_layers"], hf["num_key_value_heads"], hf["head_dim"]) == (2, 8, 64)
    assert hf["torch_dtype"] == "bfloat16" and hf["max_position_embeddings"] == 8192


def test_llama_config_rejects_custom_models_and_mismatches() -> None:
    run = {"config": {"model": {"factory": "pkg.mod:fn"}}}
    with pytest.raises(CheckpointError, match="--format torch"):
        llama_config(run, {"model.embed_tokens.weight": torch.Size([8, 8])})
    bad = {
        "model.embed_tokens.weight": torch.Size([64, 32]),
        "model.layers.0.self_attn.k_proj.weight": torch.Size([99, 32]),
    }
    with pytest.raises(CheckpointError, match="k_proj"):
        llama_config({"model": SMALL.to_dict()}, bad)


def _state(seed: int) -> tuple[Llama, dict[str, object]]:
    torch.manual_seed(seed)
    model = Llama(SMALL)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    return model, {"app": ModelOptimizerState(model, opt), "extra": {"step": seed}}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_single_process_save_resume_and_cadence(tmp_path: Path) -> None:
    model, state = _state(1)
    saver = Checkpointer(run_dir=tmp_path, cfg=CheckpointConfig(every=3, keep=1), run_meta={})
    saved = [s for s in range(1, 8) if saver.maybe_save(s, state)]
    assert saved == [3, 6]
    assert saver.maybe_save(7, state, final=True) and not saver.maybe_save(7, state, final=True)
    assert saver.last_step == 7
    assert [e.path.name for e in list_entries(tmp_path)] == ["step-00000007"]
    other, other_state = _state(2)
    resumed = Checkpointer(run_dir=tmp_path, cfg=CheckpointConfig(), run_meta={})
    assert resumed.resume(other_state) == 7
    assert other_state["extra"] == {"step": 1}
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    never = CheckpointConfig(resume="never")
    assert Checkpointer(run_dir=tmp_path, cfg=never, run_meta={}).resume(other_state) is None
    empty = Checkpointer(run_dir=tmp_path / "new", cfg=CheckpointConfig(), run_meta={})
    assert empty.resume(other_state) is None


def test_explicit_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    cfg = CheckpointConfig(resume=str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="no such directory"):
        Checkpointer(run_dir=tmp_path, cfg=cfg, run_meta={}).resume({})
