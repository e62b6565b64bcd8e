"""LoRA on Hugging Face models through fsdpkit, on 2 gloo ranks, against one process.

One spawn runs everything (start-up dominates). For an HF Llama and a GPT-2 (tied
embeddings, Conv1D) built on meta from a saved directory: peft adapters on every linear
layer of the blocks, sharded and initialized by fsdpkit, 10 steps of fsdpkit's own
training step with fsdpkit's optimizer; the frozen base must come out bit-identical,
the losses must match the same LoRA model trained unsharded in one process, and the
optimizer must hold exactly 8 bytes (AdamW's two fp32 moments) per local trainable
element. The trained adapters are checkpointed, exported as a peft adapter directory
(loaded with ``PeftModel.from_pretrained`` onto the base) and as merged HF weights
(loaded with ``from_pretrained``): both must give the trained model's logits, and the
merged weights must equal peft's own ``merge_and_unload``. A bf16 run stores the frozen
base in bf16 and must compute exactly what the fp32-stored base computes in bf16.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from fsdpkit import build_mesh, shard
from fsdpkit.config import RunConfig, load
from fsdpkit.finetune import prepare
from fsdpkit.loss.contract import logits_of, next_token_loss
from fsdpkit.models.factory import build_model
from fsdpkit.precision import PRESETS
from fsdpkit.sharding.materialize import materialize
from fsdpkit.testing import run_ranks
from fsdpkit.trainable.optim import build_optimizer
from fsdpkit.trainable.step import train_step
from support import full_state, global_batches, local

pytestmark = pytest.mark.distributed
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ARCHS = ("llama", "gpt2")
LAYERS = {"llama": 14, "gpt2": 8}
"""Linear layers in the 2 blocks: Llama 7 (q, k, v, o, gate, up, down), GPT-2 4 (Conv1D)."""
STEPS = 10
VOCAB = 256
PROBE = torch.arange(2 * 12).reshape(2, 12) * 7 % VOCAB
LORA = ["lora.rank=4", "lora.alpha=8", "train.seed=3", "train.lr=0.01", "train.warmup_steps=1"]


def _config(model_dir: str, *extra: str) -> RunConfig:
    return load(None, [f"model.hf={model_dir}", *LORA, *extra])


def _build(cfg: RunConfig, precision: str = "fp32") -> tuple[torch.nn.Module, Any]:
    assert cfg.model.hf is not None
    built = build_model(cfg.model, vocab_size=VOCAB, seq_len=16, seed=cfg.train.seed)
    ft = prepare(built.module, cfg, precision=PRESETS[precision], init=built.init)
    return built.module, ft


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return logits_of(model(PROBE), tokens=PROBE).detach().float().clone()


def _train(model: torch.nn.Module, cfg: RunConfig, *, rank: int, world: int) -> dict[str, Any]:
    """fsdpkit's optimizer and training step over the tests' global batches."""
    import torch.distributed as dist

    opt = build_optimizer(model, cfg.train)
    losses = []
    for step in global_batches(STEPS, vocab=VOCAB):
        result = train_step(
            model, opt, [local(step[0], rank, world)], loss_fn=next_token_loss, max_norm=1.0
        )
        loss = result.loss.clone()
        if world > 1:
            dist.all_reduce(loss)
        losses.append(float(loss) / world)
    return {"loss": losses, "optimizer": opt}


def _local_numel(p: torch.Tensor) -> int:
    return (p.to_local() if isinstance(p, DTensor) else p).numel()


def _optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of AdamW's moment tensors (the 0-d step counters are not per element)."""
    total = 0
    for state in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            t = state[key]
            total += _local_numel(t) * t.element_size()
    return total


def _one_arch(
    rank: int, world: int, model_dir: str, run_dir: str, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    from fsdpkit.checkpoint import Checkpointer, ModelOptimizerState
    from fsdpkit.config import CheckpointConfig

    cfg = _config(model_dir, *extra)
    model, ft = _build(cfg)
    shard(model, cfg, mesh=build_mesh(), init=ft.init)
    before = full_state(model)
    result = _train(model, cfg, rank=rank, world=world)
    trainable = [p for p in model.parameters() if p.requires_grad]
    out: dict[str, Any] = {
        "before": before,
        "after": full_state(model),
        "loss": result["loss"],
        "optimizer_bytes": _optimizer_bytes(result["optimizer"]),
        "trainable_local": sum(_local_numel(p) for p in trainable),
        "trainable_dtypes": {str(p.dtype) for p in trainable},
        "describe": ft.describe(),
        "logits": _logits(model),
    }
    meta = {"config": cfg.to_dict(), "finetune": ft.record()}
    ckpt = Checkpointer(run_dir=Path(run_dir), cfg=CheckpointConfig(every=1), run_meta=meta)
    only = cfg.checkpoint.adapters_only
    ckpt.save(STEPS, {"app": ModelOptimizerState(model, None, trainable_only=only)})
    return out


def _bf16_base(rank: int, world: int, model_dir: str) -> dict[str, Any]:
    """bf16 compute twice: base stored in fp32 (cast per all-gather) and stored in bf16
    (lora.base_dtype = auto under precision.mode = bf16)."""
    out = {}
    for base in ("fp32", "auto"):
        cfg = _config(model_dir, "precision.mode=bf16", f"lora.base_dtype={base}")
        model, ft = _build(cfg, precision="bf16")
        shard(model, cfg, mesh=build_mesh(), init=ft.init)
        frozen = {str(p.dtype) for p in model.parameters() if not p.requires_grad}
        out[base] = {"logits": _logits(model), "frozen_dtypes": frozen}
        opt = build_optimizer(model, cfg.train)
        step = global_batches(1, vocab=VOCAB)[0, 0]
        out[base]["loss"] = float(
            train_step(
                model, opt, [local(step, rank, world)], loss_fn=next_token_loss, max_norm=1.0
            ).loss
        )
    return out


EXTRA: dict[str, tuple[str, tuple[str, ...]]] = {
    # GPT-2's embedding trained in full beside the adapters: it is tied to the head
    "gpt2-wte": ("gpt2", ('lora.trainable=["transformer.wte"]',)),
    # no LoRA: two frozen blocks' worth, an adapters-only checkpoint of the rest
    "llama-freeze": (
        "llama",
        ("lora.rank=0", 'model.freeze=["model.embed_tokens.*","model.layers.0.*"]',
         "checkpoint.adapters_only=true"),
    ),
}  # fmt: skip


def _all(rank: int, world: int, dirs: dict[str, str], runs: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {a: _one_arch(rank, world, dirs[a], runs[a]) for a in ARCHS}
    for name, (arch, extra) in EXTRA.items():
        out[name] = _one_arch(rank, world, dirs[arch], runs[name], extra)
    out["bf16"] = _bf16_base(rank, world, dirs["llama"])
    return out


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tiny_hf import write_tiny_model

    os.environ["HF_HUB_OFFLINE"] = "1"
    tmp = tmp_path_factory.mktemp("lora")
    dirs = {
        a: str(write_tiny_model(tmp / a, arch=a, vocab_size=VOCAB, dim=32, tokenizer=False))
        for a in ARCHS
    }
    runs = {a: str(tmp / f"run-{a}") for a in [*ARCHS, *EXTRA]}
    dirs.update({name: dirs[arch] for name, (arch, _) in EXTRA.items()})
    ranks = run_ranks(_all, world_size=2, args=(dirs, runs), timeout_s=400)
    return {"tmp": tmp, "dirs": dirs, "runs": runs, "ranks": ranks}


def _reference(model_dir: str) -> dict[str, Any]:
    """The same LoRA model, unsharded, trained in this process."""
    cfg = _config(model_dir)
    model, ft = _build(cfg)
    assert ft.init is not None

    def init(m: torch.nn.Module) -> None:
        if hasattr(m, "tie_weights"):
            m.tie_weights()  # to_empty of a plain module unties
        ft.init(m)

    cpu = torch.device("cpu")
    materialize(model, seed=cfg.train.seed, param_device=cpu, buffer_device=cpu, init=init)
    before = full_state(model)
    return {"before": before, **_train(model, cfg, rank=0, world=1)}


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_trains_only_adapters_and_matches_one_process(
    lora_runs: dict[str, Any], arch: str
) -> None:
    ref = _reference(lora_runs["dirs"][arch])
    for got in (r[arch] for r in lora_runs["ranks"]):
        assert got["describe"].startswith(f"LoRA on {LAYERS[arch]} layers"), got["describe"]
        # the same initial model at world size 2 as unsharded (base and adapters)
        assert set(got["before"]) == set(ref["before"])
        for name, value in ref["before"].items():
            assert torch.equal(got["before"][name], value), name
        adapters = [n for n in got["before"] if ".lora_" in n]
        frozen = [n for n in got["before"] if ".lora_" not in n]
        assert len(adapters) == 2 * LAYERS[arch] and frozen
        for name in frozen:  # bit-identical after 10 steps
            assert torch.equal(got["after"][name], got["before"][name]), name
        for name in adapters:
            if ".lora_B." in name:  # zero at start (the model starts as the base)
                assert not got["before"][name].any(), name
            assert not torch.equal(got["after"][name], got["before"][name]), name
        torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-5, atol=0)
        # AdamW: exp_avg + exp_avg_sq, fp32, for the trainable elements this rank holds
        assert got["trainable_dtypes"] == {"torch.float32"}
        assert got["optimizer_bytes"] == 8 * got["trainable_local"] > 0
    ranks = lora_runs["ranks"]
    assert sum(r[arch]["trainable_local"] for r in ranks) == sum(
        p.numel() for n, p in ref["before"].items() if ".lora_" in n
    )


@pytest.mark.parametrize("arch", [*ARCHS, "gpt2-wte"])
def test_peft_and_merged_exports_give_the_trained_logits(
    lora_runs: dict[str, Any], arch: str
) -> None:
    from fsdpkit.export import export

    ckpt = Path(lora_runs["runs"][arch]) / "checkpoints" / "step-00000010"
    model_dir = lora_runs["dirs"][arch]
    trained = lora_runs["ranks"][0][arch]["logits"]
    adapter_dir = export(ckpt, lora_runs["tmp"] / f"peft-{arch}", fmt="peft")
    merged_dir = export(ckpt, lora_runs["tmp"] / f"merged-{arch}", fmt="hf", merge=True)
    auto = transformers.AutoModelForCausalLM
    with_adapters = peft.PeftModel.from_pretrained(auto.from_pretrained(model_dir), adapter_dir)
    torch.testing.assert_close(_logits(with_adapters), trained, rtol=0, atol=1e-5)
    merged = auto.from_pretrained(merged_dir, dtype=torch.float32)
    torch.testing.assert_close(_logits(merged), trained, rtol=0, atol=1e-5)
    by_peft = with_adapters.merge_and_unload().state_dict()
    mine = merged.state_dict()
    assert set(mine) == set(by_peft)
    for name, value in by_peft.items():  # base + (alpha / r) B @ A, as peft merges it
        torch.testing.assert_close(mine[name], value, rtol=0, atol=1e-6)


def test_adapters_only_checkpoint_of_a_frozen_run_exports_over_its_base(
    lora_runs: dict[str, Any],
) -> None:
    """No LoRA: the checkpoint holds the trainable parameters only, and the HF export
    lays them over the base read from the model directory."""
    from fsdpkit.export import export

    got = lora_runs["ranks"][0]["llama-freeze"]
    ckpt = Path(lora_runs["runs"]["llama-freeze"]) / "checkpoints" / "step-00000010"
    out = export(ckpt, lora_runs["tmp"] / "freeze-hf", fmt="hf")
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    state = back.state_dict()
    assert set(state) == set(got["after"])
    for name, value in got["after"].items():
        assert torch.equal(state[name], value), name
    frozen = [n for n in got["after"] if n.startswith(("model.embed", "model.layers.0."))]
    assert frozen and all(torch.equal(got["after"][n], got["before"][n]) for n in frozen)
    torch.testing.assert_close(_logits(back), got["logits"], rtol=0, atol=1e-5)


def test_bf16_base_computes_what_the_fp32_base_computes_in_bf16(
    lora_runs: dict[str, Any],
) -> None:
    for rank in lora_runs["ranks"]:
        got = rank["bf16"]
        assert got["fp32"]["frozen_dtypes"] == {"torch.float32"}
        assert got["auto"]["frozen_dtypes"] == {"torch.bfloat16"}  # half the base memory
        assert torch.equal(got["auto"]["logits"], got["fp32"]["logits"])
        assert got["auto"]["loss"] == got["fp32"]["loss"]
