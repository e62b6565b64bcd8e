"""Hugging Face interop: the LlamaConfig of a checkpoint, loading HF safetensors into
an already-sharded model, and the config/tokenizer files a ``model.hf`` export ships.

fsdpkit's Llama uses HF ``LlamaForCausalLM`` parameter names and HF's rotate-half RoPE,
so weights map one-to-one with no renaming or permutation; the built-in MoE model
(fsdpkit.models.moe) uses ``Qwen3MoeForCausalLM``'s, and exports in the per-expert
layout its ``save_pretrained`` writes (transformers' own conversion, reversed).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from fsdpkit.checkpoint.errors import CheckpointError
from fsdpkit.models.hf.directory import HF_FILES, HF_RUN_DIR
from fsdpkit.models.llama import LlamaConfig
from fsdpkit.models.moe import MoEConfig
from fsdpkit.models.presets import MOE_OVERRIDES, preset

log = logging.getLogger(__name__)

EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
_OVERRIDES = ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "tie_embeddings")
EXPERTS = "model.layers.0.mlp.experts.gate_up_proj"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _from_run(run: dict[str, Any]) -> LlamaConfig:
    """The model shape recorded with the run: ``run["model"]`` (a LlamaConfig dict) if
    the loop stored it, else the resolved config's preset + overrides."""
    if isinstance(run.get("model"), dict):
        kind = MoEConfig if "n_experts" in run["model"] else LlamaConfig
        fields = {f.name for f in dataclasses.fields(kind)}
        return kind(**{k: v for k, v in run["model"].items() if k in fields})
    model_cfg = run.get("config", {}).get("model", {})
    if model_cfg.get("factory"):
        raise CheckpointError(
            f"this checkpoint holds a custom model (model.factory = {model_cfg['factory']!r}); "
            "HF export supports fsdpkit's built-in Llama presets only. Export with "
            "--format torch instead."
        )
    name = model_cfg.get("preset", "tiny")
    overrides = {k: model_cfg[k] for k in _OVERRIDES if model_cfg.get(k) is not None}
    overrides |= {f: model_cfg[k] for k, f in MOE_OVERRIDES.items() if model_cfg.get(k)}
    seq_len = run.get("config", {}).get("data", {}).get("seq_len") or 0
    # as the training loop builds it: the RoPE table covers at least the sequence length
    overrides["max_seq_len"] = max(preset(name).max_seq_len, seq_len)
    return preset(name, **overrides)


def llama_config(run: dict[str, Any], shapes: dict[str, torch.Size]) -> LlamaConfig:
    """LlamaConfig of a checkpoint: the run's config, with the sizes that the tensors
    themselves determine (vocab from the tokenizer, depth, widths) taken from them."""
    if EMBED not in shapes:
        raise CheckpointError(
            f"the checkpoint has no {EMBED}: not an fsdpkit Llama. Use --format torch."
        )
    cfg = _from_run(run)
    layers = {int(m.group(1)) for k in shapes if (m := _LAYER.match(k))}
    vocab, dim = shapes[EMBED]
    ffn = shapes.get("model.layers.0.mlp.gate_proj.weight", torch.Size([cfg.ffn_dim]))[0]
    experts: dict[str, Any] = {}
    if isinstance(cfg, MoEConfig) and EXPERTS in shapes:
        experts = {"n_experts": shapes[EXPERTS][0], "moe_ffn_dim": shapes[EXPERTS][1] // 2}
    try:
        cfg = dataclasses.replace(
            cfg, vocab_size=vocab, dim=dim, n_layers=len(layers) or cfg.n_layers, ffn_dim=ffn,
            **experts,
        )  # fmt: skip
    except ValueError as exc:
        raise CheckpointError(f"the checkpoint's shapes contradict its config: {exc}") from None
    k_rows = shapes.get("model.layers.0.self_attn.k_proj.weight", torch.Size([0]))[0]
    if layers and k_rows != cfg.n_kv_heads * cfg.head_dim:
        raise CheckpointError(
            f"k_proj has {k_rows} rows but the config says {cfg.n_kv_heads} kv heads x "
            f"{cfg.head_dim}; the recorded config does not match the weights."
        )
    return cfg


def hf_config(cfg: LlamaConfig, *, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` for ``transformers.LlamaForCausalLM`` (4.x and 5.x field names),
    or ``Qwen3MoeForCausalLM`` for the built-in MoE model."""
    config = _llama_config(cfg, dtype=dtype)
    return config if not isinstance(cfg, MoEConfig) else _qwen3_moe(config, cfg)


def _qwen3_moe(llama: dict[str, Any], cfg: MoEConfig) -> dict[str, Any]:
    """Qwen3-MoE's config.json: Llama's fields, its expert fields, every layer sparse."""
    if cfg.n_shared_experts:
        raise CheckpointError(
            f"this built-in MoE model has {cfg.n_shared_experts} shared expert(s), which "
            "transformers' Qwen3-MoE (the family whose names and per-head norms it "
            "shares) does not have: no transformers class loads it. Export with "
            "--format torch instead."
        )
    drop = ("mlp_bias", "pretraining_tp")
    return {k: v for k, v in llama.items() if k not in drop} | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.top_k,
        "moe_intermediate_size": cfg.moe_ffn_dim,
        "norm_topk_prob": cfg.norm_topk_prob,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
        "sliding_window": None,
    }


def _llama_config(cfg: LlamaConfig, *, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "pretraining_tp": 1,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def hf_model_files(ckpt: Path, run: dict[str, Any]) -> dict[str, Path]:
    """config.json, generation config and tokenizer files of a ``model.hf`` run: the
    copy in its run directory (written at start), else the directory it trained from."""
    source = run.get("config", {}).get("model", {}).get("hf")
    places = [ckpt.parent.parent / HF_RUN_DIR, Path(str(source)).expanduser()]
    for place in places:
        if (place / "config.json").is_file():
            return {name: place / name for name in HF_FILES if (place / name).is_file()}
    raise CheckpointError(
        f"this checkpoint was trained from model.hf = {source!r}, but neither "
        f"{places[0]} (the run's copy) nor {places[1]} holds its config.json, which the "
        "export needs. Restore one of them (or copy config.json and the tokenizer files "
        "into the first) and export again."
    )


def copy_hf_model_files(files: dict[str, Path], out: Path, *, dtype: torch.dtype) -> None:
    """Copy the files into the export, its config.json saying the exported dtype (so
    ``from_pretrained`` loads the weights as written)."""
    for name, src in files.items():
        if name == "config.json":
            config = json.loads(src.read_text())
            config["dtype"] = str(dtype).removeprefix("torch.")
            if "torch_dtype" in config:
                config["torch_dtype"] = config["dtype"]
            (out / name).write_text(json.dumps(config, indent=2) + "\n")
        else:
            shutil.copyfile(src, out / name)
