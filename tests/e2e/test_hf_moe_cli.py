"""A mixture-of-experts Hugging Face directory through the CLI: the run says where its
weights and its router loss come from and logs the router's metrics; a directory with
one expert tensor removed is refused by name before any step; ``model.init_missing``
trains it anyway and says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from clirun import fsdpkit

pytestmark = pytest.mark.e2e
transformers = pytest.importorskip("transformers")

OFFLINE = {"HF_HUB_OFFLINE": "1"}
SHORT = ["train.steps=2", "train.eval_every=0", "data.max_bytes=100000", "data.seq_len=32"]
REMOVED = "model.layers.1.block_sparse_moe.experts.2.w3.weight"


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_hf import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("moe") / "mixtral", arch="mixtral", dim=32)


def _without(model_dir: Path, out: Path, key: str) -> Path:
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for f in model_dir.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(str(f))
            tensors.pop(key, None)
            save_file(tensors, str(out / f.name), metadata={"format": "pt"})
        else:
            (out / f.name).write_bytes(f.read_bytes())
    return out


def test_moe_run_states_weights_and_router_loss(mixtral: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    result = fsdpkit(
        "train", f"model.hf={mixtral}", *SHORT, f"logging.run_dir={run}", cwd=tmp_path, env=OFFLINE
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "every weight read from the directory (transformers' conversions" in result.stdout
    assert "router load-balancing loss x 0.001 added to the loss" in result.stdout
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "loss" in r][-1]
    assert last["aux_loss"] > 0 and len(last["expert_load_max_by_layer"]) == 2


def test_directory_missing_one_expert_tensor_is_refused_by_name(
    mixtral: Path, tmp_path: Path
) -> None:
    broken = _without(mixtral, tmp_path / "broken", REMOVED)
    run = tmp_path / "run"
    result = fsdpkit(
        "train", f"model.hf={broken}", *SHORT, f"logging.run_dir={run}", cwd=tmp_path, env=OFFLINE
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert REMOVED in result.stderr and "model.init_missing = true" in result.stderr
    assert "step 1/" not in result.stdout
    opted = fsdpkit(
        "train",
        f"model.hf={broken}",
        *SHORT,
        "model.init_missing=true",
        f"logging.run_dir={tmp_path / 'run2'}",
        cwd=tmp_path,
        env=OFFLINE,
    )
    assert opted.returncode == 0, opted.stderr[-3000:]
    assert "1 weight(s) NOT in the directory are freshly initialized" in opted.stdout
    assert "init_missing = true" in (tmp_path / "run2" / "config.toml").read_text()


def test_lora_on_moe_says_what_is_adapted_and_exports_peft(mixtral: Path, tmp_path: Path) -> None:
    import torch
    from peft import PeftModel

    run = tmp_path / "run"
    result = fsdpkit(
        "train",
        f"model.hf={mixtral}",
        *SHORT,
        "lora.rank=4",
        "checkpoint.every=2",
        "checkpoint.adapters_only=true",
        f"logging.run_dir={run}",
        cwd=tmp_path,
        env=OFFLINE,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LoRA on 8 layers (k_proj, o_proj, q_proj, v_proj)" in result.stdout
    assert "2 router(s) (MixtralTopKRouter) and the 4 fused expert weight(s)" in result.stdout
    ckpt = run / "checkpoints" / "step-00000002"
    for fmt, extra in (("peft", []), ("hf", ["--merge"])):
        out = tmp_path / fmt
        done = fsdpkit("ckpt", "export", str(ckpt), str(out), "--format", fmt, *extra, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
    base = transformers.AutoModelForCausalLM.from_pretrained(mixtral, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, tmp_path / "peft").merge_and_unload()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    probe = torch.arange(24).reshape(2, 12) * 7 % 320
    with torch.no_grad():
        torch.testing.assert_close(adapted(probe).logits, merged(probe).logits, rtol=0, atol=1e-5)
