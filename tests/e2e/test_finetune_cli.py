"""Fine-tuning through the CLI, as the README shows it: LoRA on a local HF model with
the shipped SFT file (prompt/completion and chat rows), adapter-only checkpoints, a
resume at another world size with the same global batch, both exports, and bad input.

The resume keeps ``train.global_batch_size = 4`` with micro-batches of 1: 2 ranks x 2
accumulated micro-batches, then 1 rank x 4; SFT losses are weighted per answer token
of the whole step, so the split over ranks and micro-batches does not change them
([Note: SFT loss weighting]).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from clirun import fsdpkit, losses, start

pytestmark = pytest.mark.e2e
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

REPO = Path(__file__).parents[2]
SFT = REPO / "examples" / "sft_tiny.jsonl"
OFFLINE = {"HF_HUB_OFFLINE": "1"}
PROBE = torch.arange(2 * 12).reshape(2, 12) * 7 % 300


def _lora(model_dir: Path, run: Path, *extra: str) -> list[str]:
    return [
        "train",
        f"model.hf={model_dir}",
        f"data.path={SFT}",
        "lora.rank=8",
        'lora.trainable=["model.embed_tokens"]',
        "checkpoint.adapters_only=true",
        "data.seq_len=128",
        "train.steps=6",
        "train.warmup_steps=2",
        "train.eval_every=3",
        "data.val_fraction=0.1",
        "logging.report=false",
        "train.global_batch_size=4",
        "train.micro_batch_size=1",
        f"logging.run_dir={run}",
        *extra,
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tiny_hf import write_tiny_model

    tmp = tmp_path_factory.mktemp("ft")
    model_dir = write_tiny_model(tmp / "tiny-chat", arch="llama", dim=32, chat=True)
    first = fsdpkit(
        *_lora(model_dir, tmp / "a", "checkpoint.every=3"),
        cwd=tmp,
        env=OFFLINE,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = fsdpkit(
        *_lora(model_dir, tmp / "b"),
        f"checkpoint.resume={tmp / 'a' / 'checkpoints' / 'step-00000003'}",
        "--nproc",
        "1",
        cwd=tmp,
        env=OFFLINE,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return {"tmp": tmp, "model": model_dir, "first": first, "resumed": resumed}


def test_lora_sft_run_reports_and_saves_adapters_only(runs: dict[str, Any]) -> None:
    out = runs["first"].stdout
    assert "LoRA on 14 layers" in out and "parameters trainable" in out
    assert "chat messages (24 rows), prompt/completion (24 rows)" in out
    assert "44 examples packed into" in out
    assert "validation: the last 4 examples" in out  # 4 of the 48 examples held out
    assert "validation loss" in out
    curve = losses(runs["tmp"] / "a")
    assert len(curve) == 6 and curve[-1] < curve[0]
    meta = json.loads((runs["tmp"] / "a/checkpoints/step-00000006/fsdpkit.json").read_text())
    assert meta["state"]["trainable_only"]
    index = (runs["tmp"] / "a/checkpoints/step-00000006/.metadata").read_bytes()
    assert b"lora_A" in index and b"base_layer" not in index  # no frozen base saved


def test_resume_at_another_world_size_continues_exactly(runs: dict[str, Any]) -> None:
    assert "resumed from step 3" in runs["resumed"].stdout
    first = losses(runs["tmp"] / "a")
    resumed = losses(runs["tmp"] / "b")
    assert len(resumed) == 3
    torch.testing.assert_close(resumed, first[3:], rtol=1e-5, atol=0)


def test_peft_and_merged_exports_agree(runs: dict[str, Any]) -> None:
    from fsdpkit.export import export

    tmp = runs["tmp"]
    ckpt = tmp / "a" / "checkpoints" / "step-00000006"
    cli = fsdpkit("ckpt", "export", str(ckpt), "--format", "peft", str(tmp / "adapter"), cwd=tmp)
    assert cli.returncode == 0, cli.stderr[-2000:]
    export(ckpt, tmp / "merged", fmt="hf", merge=True)  # the base read from model.hf
    auto = transformers.AutoModelForCausalLM
    base = auto.from_pretrained(runs["model"], dtype=torch.float32)
    embed = base.get_input_embeddings().weight.detach().clone()
    with_adapters = peft.PeftModel.from_pretrained(base, tmp / "adapter")
    merged = auto.from_pretrained(tmp / "merged", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(
            with_adapters(PROBE).logits, merged(PROBE).logits, rtol=0, atol=1e-5
        )
    # the fully trained embedding travels as modules_to_save and was trained
    assert not torch.equal(merged.get_input_embeddings().weight, embed)


def _bad_cases(tmp: Path) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (overrides, what the one-paragraph error must name)."""
    from tiny_hf import write_tokenizer

    plain = tmp / "plain-tokenizer"
    plain.mkdir(exist_ok=True)
    write_tokenizer(plain, vocab_size=320)  # no chat template
    rows = {
        "role": {"messages": [{"role": "tool", "content": "x"}]},
        "empty": {"prompt": "Say hi.", "completion": ""},
    }
    files = {}
    for name, row in rows.items():
        files[name] = tmp / f"{name}.jsonl"
        good = json.dumps({"prompt": "a", "completion": "b"})
        files[name].write_text(f"{good}\n{json.dumps(row)}\n")
    return {
        "target": (['lora.targets=["qkv_proj"]'], ["lora.targets", "'qkv_proj'", "q_proj"]),
        "role": ([f"data.path={files['role']}"], [f"{files['role']}:2", "role 'tool'"]),
        "empty": ([f"data.path={files['empty']}"], [f"{files['empty']}:2", "completion is empty"]),
        "template": (
            [f"data.tokenizer={plain}"],
            ["chat template", str(plain), "prompt/completion"],
        ),
    }


def test_bad_input_is_one_paragraph_and_exit_2(runs: dict[str, Any]) -> None:
    """Each case in-process (a UserError, i.e. exit 2, before any process group), and
    two of them through the CLI (the launcher prints the worker's paragraph once)."""
    from fsdpkit.config import load
    from fsdpkit.errors import UserError
    from fsdpkit.runtime.distenv import DistEnv
    from fsdpkit.train.session import build_session

    tmp, model_dir = runs["tmp"], runs["model"]
    cases = _bad_cases(tmp)
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device_type="cpu")
    for name, (args, needles) in cases.items():
        cfg = load(None, _lora(model_dir, tmp / f"lib-{name}", *args)[1:])
        with pytest.raises(UserError) as err:
            build_session(cfg, env)
        assert all(n in str(err.value) for n in needles), (name, str(err.value))
        assert "\n" not in str(err.value)
    # resuming the adapters onto another base, or into a run that loads the whole model
    from tiny_hf import write_tiny_model

    other = write_tiny_model(tmp / "other-base", arch="llama", dim=32, chat=True, seed=1)
    step3 = f"checkpoint.resume={tmp / 'a' / 'checkpoints' / 'step-00000003'}"
    cases["base"] = (
        [step3, f"model.hf={other}"],
        ["different frozen base", "fingerprint", "model.hf"],
    )
    cases["whole"] = ([step3, "checkpoint.adapters_only=false"], ["holds only the trainable"])
    jobs = {
        name: start(
            *_lora(model_dir, tmp / f"bad-{name}", *cases[name][0]), "--nproc", "1", cwd=tmp
        )
        for name in ("target", "template", "base", "whole")
    }
    for name, job in jobs.items():
        _, err = job.communicate(timeout=120)
        assert job.returncode == 2, (name, err[-2000:])
        assert "Traceback" not in err, err[-2000:]
        for text in cases[name][1]:
            assert text in err, (name, err[-2000:])
        assert len([line for line in err.splitlines() if "error" in line]) == 1, err[-2000:]
