"""Pipeline parallelism (``parallel.pp``) on 4 gloo ranks trains exactly as one process.

Each layout runs the real trainer (``build_session`` + ``train.loop.run``, the code
``fsdpkit train`` runs) on the built-in corpus: 10 AdamW steps in fp32 with
global-norm clipping (lr 2e-4, clip 1.0; the norms are 2.5-3.6, so every step clips),
an evaluation at steps 5 and 10, against the same config trained by one process
(``parallel.pp = 1``, world 1). Losses, grad norms, validation losses (where the
pipelined run has one data-parallel rank, so it evaluates the same batches) and
every final parameter (gathered by name from the rank that holds it) agree within
1e-5. The fast test trains pp2 x dp2 with 1F1B, of the model with a tied embedding and
head; the other layouts (untied 1F1B, Interleaved1F1B, pp4, pp2 x tp2, a transformers
Llama, the remaining schedules, cp, AC, the chunked loss, and tied with the V
schedules, at pp4, pp2 x tp2, pp2 x cp2, in transformers' Llama with
``tie_word_embeddings`` and in transformers' Gemma) are slow-marked and run in the same
way.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from fsdpkit.config import load
from fsdpkit.runtime.distenv import joined_env
from fsdpkit.testing import run_ranks
from fsdpkit.train.loop import run
from fsdpkit.train.session import build_session
from support import full_state, preference_pairs

sys.path.insert(0, str(Path(__file__).parents[1] / "e2e"))  # factories (spawned ranks inherit)
pytestmark = pytest.mark.distributed

TOL = 1e-5
STEPS = 10
BASE = [
    *("model.preset=tiny", "model.dim=64", "model.n_layers=4", "model.n_heads=4"),
    *("model.n_kv_heads=2", "model.ffn_dim=128", "model.tie_embeddings=false"),
    *("data.seq_len=32", f"train.steps={STEPS}", "train.lr=2e-4", "train.warmup_steps=0"),
    *("train.grad_clip=1.0", "train.eval_every=5", "train.eval_batches=2"),
    *("train.sample_tokens=0", "precision.mode=fp32", "logging.progress=none"),
    *("checkpoint.every=0", "checkpoint.resume=never"),
]  # fmt: skip
BATCH = ["train.global_batch_size=8", "train.micro_batch_size=1"]
"""8 sequences a step: 4 micro-batches per rank at dp2, 8 at dp1 (enough for every
schedule at pp2 and pp4)."""

LAYOUTS: dict[str, list[str]] = {
    "pp2xdp2-1f1b": ["parallel.pp=2"],
    "pp2xdp2-interleaved": ["parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B"],
    "pp4": ["parallel.pp=4"],
    "pp2xtp2": ["parallel.pp=2", "parallel.tp=2"],
    "hf-llama-pp2xdp2": ["parallel.pp=2"],
    "pp2xdp2-gpipe": ["parallel.pp=2", "parallel.pp_schedule=GPipe"],
    "pp2xdp2-loopedbfs": ["parallel.pp=2", "parallel.pp_schedule=LoopedBFS"],
    "pp2xdp2-izb": ["parallel.pp=2", "parallel.pp_schedule=InterleavedZeroBubble"],
    "pp2xdp2-zbv": ["parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble"],
    "pp2xdp2-dualpipev": ["parallel.pp=2", "parallel.pp_schedule=DualPipeV"],
    "pp2xcp2": ["parallel.pp=2", "parallel.cp=2"],
    "pp2xdp2-ac-fulllogits-params": [
        *("parallel.pp=2", "activations.mode=full", "train.chunked_loss=off"),
        "parallel.pp_split=params",
    ],
    "pp2-hybrid": ["parallel.pp=2", "parallel.strategy=hybrid", "parallel.shard_degree=1"],
    "factory-mlp-pp2xdp2": ["parallel.pp=2"],
    "sft-hf-llama-pp2xcp2": ["parallel.pp=2", "parallel.cp=2"],
    "tied-pp2xdp2-1f1b": ["parallel.pp=2"],
    "tied-pp2xdp2-zbv": ["parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble"],
    "tied-pp2xdp2-dualpipev": ["parallel.pp=2", "parallel.pp_schedule=DualPipeV"],
    "tied-pp4": ["parallel.pp=4"],
    "tied-pp2xtp2-interleaved": [
        *("parallel.pp=2", "parallel.tp=2", "parallel.pp_schedule=Interleaved1F1B"),
    ],
    "tied-pp2xcp2": ["parallel.pp=2", "parallel.cp=2"],
    "tied-hf-llama-pp2xdp2": ["parallel.pp=2"],
    "tied-hf-gemma-pp2xdp2": ["parallel.pp=2"],
    "lora-pp2xdp2": ["parallel.pp=2", "checkpoint.adapters_only=true"],
    "lora-tied-pp2xdp2-1f1b": ["parallel.pp=2"],
    "lora-tied-pp2xdp2-zbv": ["parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble"],
    "freeze-pp2xdp2": ["parallel.pp=2"],
    "offload-pp2xdp2": ["parallel.pp=2", "offload.params=true"],
    "initfrom-pp2xdp2": ["parallel.pp=2"],
    "dpo-lora-pp2xdp2": ["parallel.pp=2"],
    "dpo-full-pp2xdp2": ["parallel.pp=2"],
    "dpo-full-tied-pp2xdp2-zbv": ["parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble"],
    "dpo-simpo-pp2xdp2": ["parallel.pp=2"],
}
"""Layout name -> its overrides; "hf-" layouts train a transformers Llama directory,
"factory-" ones a ``model.factory`` model without HF's accessors (residual-MLP blocks,
its embedding and head found as the one nn.Embedding and nn.Linear outside them), "sft-"
ones packed chat rows (examples/sft_tiny.jsonl) on a transformers Llama with a chat
template, "tied-" ones a model whose head is its embedding ([Note: tied embeddings
across stages]: each end's copy is checked against the one process's weight); the
fine-tuning ones train LoRA adapters ("lora-"; "lora-tied-" on the tied model, its
frozen weight on two stages or, under the V schedule, one rank), a frozen half of the blocks
("freeze-"), with parameters offloaded to the CPU ("offload-": the one process
trains without, the math is the same), DPO with LoRA (the reference: the base with the
adapters off, in a pass of its own through the stages), full fine-tuning DPO (a
separate reference in the same stages; "dpo-full-tied-": of the tied model under the V
schedule, both ends of the reference on one rank) and reference-free SimPO ("dpo-")
and from ``model.init_from`` weights of another
built-in model ("initfrom-")."""
FINETUNE = {
    "lora-tied-": ["lora.rank=4", "lora.alpha=8", "model.tie_embeddings=true"],
    "lora-": ["lora.rank=4", "lora.alpha=8"],
    "dpo-lora-": ["train.objective=dpo", "dpo.beta=0.5", "lora.rank=4", "lora.alpha=8"],
    "dpo-full-tied-": ["train.objective=dpo", "dpo.beta=0.5", "model.tie_embeddings=true"],
    "dpo-full-": ["train.objective=dpo", "dpo.beta=0.5"],
    "dpo-simpo-": ["train.objective=dpo", "dpo.loss=simpo", "train.lr=2e-3"],
    "freeze-": ["model.freeze=['model.layers.0.*', 'model.layers.1.*']"],
}
"""The settings both sides of a fine-tuning layout train with."""
FAST = ("tied-pp2xdp2-1f1b",)
"""In make test: pp2 x dp2 with 1F1B of the tied model (the untied one's path and the
tie's)."""
SINGLE_DP = ("pp4", "pp2xtp2", "pp2xcp2", "tied-pp4", "tied-pp2xtp2-interleaved", "tied-pp2xcp2")
"""Layouts with one data-parallel rank: they evaluate the one process's batches."""


def _train(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    env = joined_env()
    assert env is not None and env.world_size == world
    session = build_session(load(None, overrides), env)
    run(session)
    return {
        "params": full_state(session.trainable.model),
        "pipeline": session.trainable.pipeline is not None,
    }


def _metrics(run_dir: Path) -> dict[str, list[float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = ("loss", "grad_norm", "val_loss", "rewards/chosen", "rewards/margin")
    return {key: [r[key] for r in records if key in r] for key in keys}


def _overrides(name: str, tmp: Path) -> list[str]:
    shape = ("model.preset", "model.dim", "model.n_", "model.ffn", "model.tie")
    common = [*[o for o in BASE if not o.startswith(shape)], *BATCH]
    if name.startswith("factory-"):
        return [*common, "model.factory=factories:token_mlp"]
    if name.startswith("sft-"):
        from tiny_hf import write_tiny_model

        chat = tmp / "hf-llama-chat"
        if not chat.exists():
            write_tiny_model(chat, arch="llama", layers=4, chat=True)
        rows = Path(__file__).parents[2] / "examples" / "sft_tiny.jsonl"
        sft = [f"model.hf={chat}", f"data.path={rows}", "data.seq_len=128"]
        return [*[o for o in common if not o.startswith("data.seq_len")], *sft]
    finetune = _finetune(name, tmp, common)
    if finetune is not None:
        return finetune
    if name.startswith("tied-") and not name.startswith("tied-hf-"):
        return [
            *[o for o in BASE if not o.startswith("model.tie")],
            "model.tie_embeddings=true",
            *BATCH,
        ]
    if not name.startswith(("hf-", "tied-hf-")):
        return [*BASE, *BATCH]
    from tiny_hf import write_tiny_model

    arch = name.split("-")[-2] if name.startswith("tied-") else "llama"
    model = tmp / name.removesuffix("-pp2xdp2")
    if not model.exists() and arch == "llama" and name.startswith("tied-"):
        _write_tied_llama(model)
    elif not model.exists():  # transformers' Gemma is tied
        write_tiny_model(model, arch=arch, layers=4)
    return [*common, f"model.hf={model}"]


def _finetune(name: str, tmp: Path, common: list[str]) -> list[str] | None:
    """The overrides of a fine-tuning layout (None: not one)."""
    for prefix, settings in FINETUNE.items():
        if name.startswith(prefix):
            data = [f"data.path={preference_pairs(tmp)}"] if prefix.startswith("dpo-") else []
            return [*BASE, *BATCH, *settings, *data]
    if not name.startswith("initfrom-"):
        return None
    weights = tmp / "initfrom-weights"
    if not weights.exists():
        _write_builtin_weights(weights, seed=7)
    return [*BASE, *BATCH, f"model.init_from={weights}"]


def _write_builtin_weights(out: Path, *, seed: int) -> None:
    """The built-in model of BASE with other weights, as HF safetensors (its names are
    transformers' Llama's) and config.json: what model.init_from reads."""
    import torch
    from safetensors.torch import save_file

    from fsdpkit import init_weights
    from fsdpkit.export.hf_files import hf_config
    from fsdpkit.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128,
        max_seq_len=32, tie_embeddings=False,
    )  # fmt: skip
    model = Llama(cfg)
    init_weights(model, seed=seed)
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(hf_config(cfg, dtype=torch.float32)))


def _write_tied_llama(out: Path) -> None:
    """A tiny transformers Llama with ``tie_word_embeddings`` (its file holds the
    embedding only)."""
    import torch
    import transformers as T
    from tiny_hf import tiny_config, write_tokenizer

    config = tiny_config("llama", layers=4)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(str(out))
    write_tokenizer(out, vocab_size=config.vocab_size)


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One-process runs, by model ("llama" / "hf"), made when first asked for."""
    return {"tmp": tmp_path_factory.mktemp("pp-ref")}


def _reference(refs: dict[str, Any], name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    prefixes = ("tied-hf-llama", "tied-hf-gemma", "hf-", "factory-", "sft-", "tied-")
    prefixes += ("lora-tied-", "lora-", "freeze-", "initfrom-", "dpo-lora-", "dpo-simpo-")
    prefixes += ("dpo-full-tied-", "dpo-full-")
    kind = next((p for p in prefixes if name.startswith(p)), "llama")
    if kind not in refs:
        tmp: Path = refs["tmp"]
        run_dir = tmp / f"ref-{kind}"
        overrides = [*_overrides(name, tmp), f"logging.run_dir={run_dir}"]
        out = run_ranks(_train, world_size=1, args=(overrides,), timeout_s=600)[0]
        refs[kind] = (out, _metrics(run_dir))
    return refs[kind]  # type: ignore[no-any-return]


def _check(name: str, refs: dict[str, Any]) -> None:
    tmp: Path = refs["tmp"]
    ref_out, ref_metrics = _reference(refs, name)
    run_dir = tmp / name
    overrides = [*_overrides(name, tmp), *LAYOUTS[name], f"logging.run_dir={run_dir}"]
    ranks = run_ranks(_train, world_size=4, args=(overrides,), timeout_s=900)
    assert all(r["pipeline"] for r in ranks)
    got = _metrics(run_dir)
    assert len(got["loss"]) == STEPS
    keys = ("loss", "grad_norm") + (("val_loss",) if name in SINGLE_DP else ())
    keys += ("rewards/chosen", "rewards/margin") if name.startswith("dpo-") else ()
    for key in keys:
        worst = max(abs(a - b) for a, b in zip(got[key], ref_metrics[key], strict=True))
        print(f"{name}: {key} worst difference {worst:.2e}")
        assert worst < TOL, f"{name}: {key} {got[key]} vs {ref_metrics[key]}"
    names: set[str] = set()
    worst = 0.0
    for rank, out in enumerate(ranks):  # a tied weight: both stages' copies
        names.update(out["params"])
        for key, value in out["params"].items():
            diff = (value - ref_out["params"][key]).abs().max().item()
            assert diff < TOL, f"{name}: {key} on rank {rank} differs by {diff:.2e}"
            worst = max(worst, diff)
    print(f"{name}: final parameters worst difference {worst:.2e}")
    assert names == set(ref_out["params"])  # every parameter, the model's names


@pytest.mark.parametrize("name", FAST)
def test_pipeline_trains_as_one_process(name: str, references: dict[str, Any]) -> None:
    _check(name, references)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in LAYOUTS if n not in FAST])
def test_pipeline_layouts_train_as_one_process(name: str, references: dict[str, Any]) -> None:
    _check(name, references)
