"""DPO on 2 gloo ranks against a one-process reference written here in plain torch.

A tiny transformers Llama (saved with save_pretrained, ChatML tokenizer) trains 10 DPO
steps through ``build_session`` + ``run`` (what ``fsdpkit train`` runs) on string and
conversational preference rows, fp32, 2 pairs per rank in 2 micro-batches of 1: once as
a full fine-tune with a separate FSDP2-sharded reference model, once with LoRA and the
reference taken from the same sharded model with its adapters off, once with the
reference-free SimPO loss (no reference model built), once with ``dpo.reference`` naming
another model directory (other weights: the first step's rewards are not 0). The reference run
here holds the unsharded HF model, a frozen deep copy as the reference (so the
adapters-off trick is checked against a real second model), the same rows in the same
steps (fsdpkit's loader at world size 1 with the same global batch), the DPO formula
written out (log_softmax, gather, mask) and torch's AdamW: every step's loss and
rewards must agree within 1e-5. The checkpoints hold the policy only (LoRA with
checkpoint.adapters_only: the adapters only), never the reference. Then the full run's
step-5 checkpoint is resumed on ONE rank (train.global_batch_size keeps the 4 pairs per
step): steps 6-10 must repeat.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from tiny_hf import write_tiny_model
from torch.distributed.tensor import DTensor

from fsdpkit.config import load
from fsdpkit.data.loader import Loader
from fsdpkit.data.preference import load_pairs
from fsdpkit.data.tokenizer import build_tokenizer
from fsdpkit.models.hf.directory import with_model_tokenizer
from fsdpkit.runtime.distenv import joined_env
from fsdpkit.testing import run_ranks
from fsdpkit.train.loop import run
from fsdpkit.train.session import build_session

pytestmark = pytest.mark.distributed
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

STEPS, BETA, LR, PAIRS_PER_STEP, GAMMA = 10, 0.5, 5e-3, 4, 0.25
KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin")
LORA = ["lora.rank=4", "lora.alpha=8"]


def _rows() -> list[dict[str, Any]]:
    words = ["red", "blue", "green", "cyan", "gold", "pink", "gray", "teal"]
    rows: list[dict[str, Any]] = []
    for i in range(24):
        a, b = words[i % 8], words[(3 * i + 1) % 8]
        if i % 3 == 0:  # TRL conversational: prompt messages, assistant answers
            rows.append(
                {
                    "prompt": [{"role": "user", "content": f"colour {i}?"}],
                    "chosen": [{"role": "assistant", "content": a * 2}],
                    "rejected": [{"role": "assistant", "content": b}],
                }
            )
        else:
            rows.append({"prompt": f"q{i}: ", "chosen": f"{a} {a}", "rejected": f"{b}!"})
    return rows


def _overrides(model_dir: Path, data: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"model.hf={model_dir}",
        f"data.path={data}",
        f"logging.run_dir={run_dir}",
        "train.objective=dpo",
        f"dpo.beta={BETA}",
        f"train.steps={STEPS}",
        f"train.global_batch_size={PAIRS_PER_STEP}",
        "train.micro_batch_size=1",
        f"train.lr={LR}",
        "train.schedule=constant",
        "train.warmup_steps=0",
        "train.weight_decay=0",
        "train.grad_clip=0",
        "train.eval_every=0",
        "train.sample_tokens=0",
        "train.seed=3",
        "data.seq_len=40",
        "data.val_fraction=0",
        "precision.mode=fp32",
        "logging.progress=none",
        "logging.report=false",
        *extra,
    ]


def _train(rank: int, world: int, runs: list[list[str]]) -> list[bool | None]:
    """Each run; whether its reference model (None: none) is back to shards after the
    run's last step (a no-grad forward has no backward to reshard the root for it)."""
    del rank
    env = joined_env()
    assert env is not None and env.world_size == world
    sharded: list[bool | None] = []
    for overrides in runs:
        session = build_session(load(None, overrides), env)
        run(session)
        ref = session.trainable.loss_fn.reference  # type: ignore[attr-defined]
        sharded.append(
            None if ref is None else all(isinstance(p, DTensor) for p in ref.parameters())
        )
    return sharded


def _saved_keys(step_dir: Path) -> list[str]:
    return list(dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata)


def _metrics(run_dir: Path) -> list[dict[str, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def _logps(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of log p(target) over the answer positions (targets != -100) of each row."""
    logp = torch.log_softmax(model(inputs).logits.float(), dim=-1)
    mask = targets != -100
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(-1)


def _rewards(policy: Any, reference: Any, batch: Any, *, simpo: bool) -> torch.Tensor:
    """beta x (policy - reference) log-probs per row; SimPO: beta x the policy's
    log-prob per answer token (no reference)."""
    logps = _logps(policy, batch.inputs, batch.targets)
    if simpo:
        return BETA * logps / (batch.targets != -100).sum(-1)
    with torch.no_grad():
        ref = _logps(reference, batch.inputs, batch.targets)
    return BETA * (logps - ref)


def _reference(
    model_dir: Path,
    overrides: list[str],
    *,
    lora: bool,
    simpo: bool = False,
    reference_dir: Path | None = None,
) -> list[dict[str, float]]:
    cfg = with_model_tokenizer(load(None, overrides))
    pairs = load_pairs(cfg.data, build_tokenizer(cfg.data)).train
    loader = Loader(pairs, micro_batch_size=PAIRS_PER_STEP, dp_rank=0, dp_world=1, seed=3)
    policy = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    if reference_dir is not None:
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            str(reference_dir), dtype=torch.float32
        ).requires_grad_(False)
    if lora:
        from fsdpkit.finetune.lora import init_adapters

        names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=names, bias="none")
        peft.inject_adapter_in_model(config, policy, adapter_name="default")
        init_adapters(policy, seed=3)  # fsdpkit's seeded lora_A draw, lora_B = 0
        for name, p in policy.named_parameters():
            p.requires_grad_("lora_" in name)
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    out = []
    for _ in range(STEPS):
        rewards = _rewards(policy, reference, loader.next_batch(), simpo=simpo)
        chosen, rejected = rewards[0::2], rewards[1::2]
        loss = -F.logsigmoid(chosen - rejected - (GAMMA if simpo else 0.0)).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        c, r = chosen.detach(), rejected.detach()
        values = [loss.item(), c.mean(), r.mean(), (c > r).float().mean(), (c - r).mean()]
        out.append(dict(zip(KEYS, map(float, values))))
    return out


def _close(got: list[dict[str, float]], want: list[dict[str, float]], *, what: str) -> None:
    assert len(got) == len(want), what
    for step, (g, w) in enumerate(zip(got, want), start=1):
        for key in KEYS:
            assert abs(g[key] - w[key]) <= 1e-5, (what, step, key, g[key], w[key])


def test_dpo_matches_one_process_reference_full_and_lora_and_resumes_at_one_rank(
    tmp_path: Path,
) -> None:
    model_dir = write_tiny_model(tmp_path / "model", chat=True, vocab_size=320)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    full = _overrides(model_dir, data, tmp_path / "full", "checkpoint.every=5")
    lora = _overrides(
        model_dir,
        data,
        tmp_path / "lora",
        *LORA,
        "checkpoint.every=10",
        "checkpoint.adapters_only=true",
    )
    simpo = _overrides(
        model_dir, data, tmp_path / "simpo", "dpo.loss=simpo", f"dpo.simpo_gamma={GAMMA}"
    )
    other = write_tiny_model(tmp_path / "other", seed=1, vocab_size=320, tokenizer=False)
    separate = _overrides(model_dir, data, tmp_path / "separate", f"dpo.reference={other}")
    runs = [full, lora, simpo, separate]
    sharded = run_ranks(_train, world_size=2, args=(runs,), timeout_s=400)
    assert sharded == [[True, None, None, True]] * 2  # LoRA and SimPO build no second model

    got_full, got_lora = _metrics(tmp_path / "full"), _metrics(tmp_path / "lora")
    _close(got_full, _reference(model_dir, full, lora=False), what="full fine-tune")
    _close(got_lora, _reference(model_dir, lora, lora=True), what="LoRA, adapters off")
    want = _reference(model_dir, simpo, lora=False, simpo=True)
    _close(_metrics(tmp_path / "simpo"), want, what="SimPO (reference-free)")
    want = _reference(model_dir, separate, lora=False, reference_dir=other)
    _close(_metrics(tmp_path / "separate"), want, what="dpo.reference = another model")
    assert _metrics(tmp_path / "separate")[0]["rewards/margin"] != 0.0
    assert got_full[-1]["rewards/margin"] > got_full[0]["rewards/margin"]  # it trained

    step5 = tmp_path / "full" / "checkpoints" / "step-00000005"
    names = dict(
        transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).named_parameters()
    )
    saved = [k for k in _saved_keys(step5) if k.startswith("app.model.")]
    assert sorted(saved) == sorted(f"app.model.{n}" for n in names)  # never the reference
    lora_dir = tmp_path / "lora" / "checkpoints" / "step-00000010"
    adapters = [k for k in _saved_keys(lora_dir) if k.startswith("app.model.")]
    assert adapters and all("lora_" in k for k in adapters), adapters
    resumed = _overrides(
        model_dir,
        data,
        tmp_path / "resumed",
        f"checkpoint.resume={step5}",
        "train.micro_batch_size=2",
    )
    run_ranks(_train, world_size=1, args=([resumed],), timeout_s=300)
    got = _metrics(tmp_path / "resumed")
    assert [r["step"] for r in got] == list(range(6, STEPS + 1))
    _close(got, got_full[5:], what="resumed at 1 rank")
