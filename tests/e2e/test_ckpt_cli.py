"""``fsdpkit ckpt`` through a subprocess, as a user runs it: list, inspect, verify, export.

The checkpoint comes from a single-process Checkpointer (no process group), with the
run's resolved config recording a preset + overrides, so HF export resolves the shape
the way it does for real runs. Independent commands run concurrently (start-up is ~3 s
of torch import each).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdpkit import init_weights
from fsdpkit.checkpoint import Checkpointer, ModelOptimizerState
from fsdpkit.config import CheckpointConfig, ModelConfig, RunConfig
from fsdpkit.models.llama import Llama, preset

pytestmark = pytest.mark.e2e

OVERRIDES = {"n_layers": 2, "dim": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128}


def _make_run(run: Path) -> Llama:
    model = Llama(preset("tiny", vocab_size=96, **OVERRIDES))  # tied head, vocab from "tokenizer"
    init_weights(model, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 8, dtype=torch.long)).float().pow(2).mean().backward()
    opt.step()
    config = RunConfig(model=ModelConfig(preset="tiny", **OVERRIDES)).to_dict()
    meta = {"world_size": 1, "mesh": [1, 1], "strategy": "full", "config": config}
    saver = Checkpointer(run_dir=run, cfg=CheckpointConfig(), run_meta=meta)
    saver.save(7, {"app": ModelOptimizerState(model, opt), "trainer": {"step": 7}})
    (run / "checkpoints" / "step-00000009.tmp").mkdir()  # a crashed save
    return model


def _cli(*args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "fsdpkit", "ckpt", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _all(procs: dict[str, subprocess.Popen[str]]) -> dict[str, tuple[int, str, str]]:
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        out[name] = (p.returncode, stdout, stderr)
    return out


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    tmp = tmp_path_factory.mktemp("cli")
    run = tmp / "run"
    model = _make_run(run)
    ckpt = run / "checkpoints" / "step-00000007"
    first = _all(
        {
            "list": _cli("list", str(run)),
            "inspect_json": _cli("inspect", str(ckpt), "--json"),
            "inspect": _cli("inspect", str(ckpt)),
            "verify": _cli("verify", str(ckpt)),
            "hf": _cli("export", str(ckpt), "--format", "hf", str(tmp / "hf")),
            "torch": _cli(
                "export", str(ckpt), "--format", "torch", str(tmp / "w.pt"), "--dtype", "bf16"
            ),
        }
    )
    data = bytearray((ckpt / "__0_0.distcp").read_bytes())
    data[100] ^= 0xFF
    (ckpt / "__0_0.distcp").write_bytes(bytes(data))
    second = _all(
        {
            "corrupt": _cli("verify", str(ckpt)),
            "missing": _cli("inspect", str(tmp / "nowhere")),
        }
    )
    return {"tmp": tmp, "model": model, **first, **second}


def test_list_shows_complete_and_partial(session: dict) -> None:
    code, out, _ = session["list"]
    assert code == 0
    lines = out.splitlines()
    assert "7" in lines[1] and lines[1].endswith("complete")
    assert "9" in lines[2] and lines[2].endswith("partial")


def test_inspect(session: dict) -> None:
    code, out, _ = session["inspect_json"]
    assert code == 0
    info = json.loads(out)
    assert (info["step"], info["world_size"], info["strategy"]) == (7, 1, "full")
    assert info["tensors"] > 10 and set(info["bytes_by_dtype"]) == {"float32"}
    assert info["bytes_by_section"]["optimizer"] > info["bytes_by_section"]["model"]
    assert info["largest"][0]["bytes"] >= info["largest"][-1]["bytes"]
    code, out, _ = session["inspect"]
    assert code == 0 and "largest tensors:" in out and "world size   1" in out


def test_verify_ok_then_corrupt(session: dict) -> None:
    code, out, _ = session["verify"]
    assert code == 0 and "OK" in out
    code, out, err = session["corrupt"]
    assert code == 1
    assert "__0_0.distcp is corrupt" in out + err


def test_user_error_is_one_paragraph_exit_2(session: dict) -> None:
    code, out, err = session["missing"]
    assert code == 2 and out == ""
    assert err.startswith("fsdpkit ckpt: error:") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and "fsdpkit.json is missing" in err


def test_export_hf_matches_transformers(session: dict) -> None:
    transformers = pytest.importorskip("transformers")
    assert session["hf"][0] == 0, session["hf"][2]
    out = session["tmp"] / "hf"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]  # tied: HF re-ties it
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 96 and config["tie_word_embeddings"] is True
    hf = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    tokens = torch.arange(20).remainder(96).unsqueeze(0)
    with torch.no_grad():
        ref = session["model"](tokens)
        got = hf(tokens).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_export_torch_bf16_loads_weights_only(session: dict) -> None:
    assert session["torch"][0] == 0, session["torch"][2]
    weights = torch.load(session["tmp"] / "w.pt", weights_only=True)
    model = session["model"]
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    for name, p in model.state_dict().items():
        assert torch.equal(weights[name], p.bfloat16()), name
