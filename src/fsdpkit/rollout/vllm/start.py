"""Starting a rank's vLLM engine for a run: what it builds, how big its KV cache is,
where it logs ([Note: the vLLM engine]).

- The model: ``model.hf``'s directory (vLLM reads its config.json only: weights are
  pushed), or for a built-in preset the config.json ``fsdpkit export`` writes for it
  (fsdpkit.export.hf_files), in the run directory.
- The dtype: the trainer's compute dtype, so the engine computes with the values the
  trainer's forward uses.
- The KV cache: ``rl.vllm_kv_cache_mb``, or sized to one rollout of this rank (its
  prompts x rl.num_generations sequences of max_prompt_length + max_completion_length
  tokens, in blocks of 128, plus one block each).
- The log: ``<run_dir>/vllm/engine-rank<R>.log``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdpkit.config import RunConfig
from fsdpkit.export.hf_files import hf_config
from fsdpkit.export.offline import moe_shadow
from fsdpkit.models.hf.construct import construct
from fsdpkit.models.hf.directory import read_hf_dir
from fsdpkit.models.llama import LlamaConfig
from fsdpkit.planner.replay.vllmmem import kv_cache_bytes
from fsdpkit.rollout.vllm.engine import VllmEngine, agree
from fsdpkit.rollout.vllm.process import (
    EngineProcess,
    EngineSpec,
    VllmEngineError,
    default_python,
)
from fsdpkit.rollout.vllm.sync import largest_bytes, layout
from fsdpkit.rollout.vllm.wire import dtype_name

MIB = 1 << 20


def _rank() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _model_dir(cfg: RunConfig, model: nn.Module, *, dtype: torch.dtype, rank: int) -> Path:
    """The directory vLLM builds the model from."""
    if cfg.model.hf:
        return Path(cfg.model.hf).expanduser().resolve()
    out = Path(cfg.logging.run_dir) / "vllm" / f"model-rank{rank}"
    out.mkdir(parents=True, exist_ok=True)
    shape = model.config
    assert isinstance(shape, LlamaConfig)  # not model.hf: a built-in preset
    config = hf_config(shape, dtype=dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out.resolve()


def _shadow(cfg: RunConfig, model_dir: Path) -> nn.Module | None:
    """The transformers model on meta whose reverse conversion is the push's layout."""
    if cfg.model.hf:
        return construct(read_hf_dir(model_dir).config)
    config = json.loads((model_dir / "config.json").read_text())
    return moe_shadow(config) if config["model_type"] != "llama" else None


def _kv_shape(cfg: RunConfig, model: nn.Module) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of the policy."""
    shape = getattr(model, "config", None)
    if isinstance(shape, LlamaConfig):
        return shape.n_layers, shape.n_kv_heads, shape.head_dim
    config = read_hf_dir(cfg.model.hf or "").config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    return text.num_hidden_layers, kv, head_dim


def start_vllm(
    cfg: RunConfig,
    *,
    model: nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    decode: Any,
) -> VllmEngine:
    """Start this rank's engine and wait until every rank's is ready (collective: an
    engine that fails stops every rank with its paragraph)."""
    rl = cfg.rl
    rank, world = _rank()
    model_dir = _model_dir(cfg, model, dtype=dtype, rank=rank)
    max_len = rl.max_prompt_length + rl.max_completion_length
    prompts = max(1, (cfg.train.global_batch_size or rl.num_generations) // rl.num_generations)
    sequences = math.ceil(prompts / world) * rl.num_generations
    layers, kv_heads, head_dim = _kv_shape(cfg, model)
    kv = rl.vllm_kv_cache_mb * MIB or kv_cache_bytes(
        layers=layers, kv_heads=kv_heads, head_dim=head_dim, itemsize=dtype.itemsize,
        sequences=sequences, tokens=max_len,
    )  # fmt: skip
    spec = EngineSpec(
        model=str(model_dir),
        dtype=dtype_name(dtype),
        max_model_len=max_len,
        kv_cache_bytes=int(kv),
        sleep_mode=rl.vllm_enable_sleep_mode and device.type == "cuda",
        enforce_eager=device.type == "cpu",  # vLLM's CPU compile costs ~25 s per start
    )
    error, process, engine = None, None, None
    try:
        process = EngineProcess(
            spec,
            python=rl.vllm_python or default_python(),
            log=Path(cfg.logging.run_dir) / "vllm" / f"engine-rank{rank}.log",
            bucket_bytes=max(rl.vllm_sync_bucket_mb * MIB, largest_bytes(model, dtype=dtype)),
            threads=torch.get_num_threads(),
            cuda_index=device.index if device.type == "cuda" else None,
            rank=rank,
        )
        engine = VllmEngine(
            model, process=process, plan=layout(model, shadow=_shadow(cfg, model_dir)),
            dtype=dtype, decode=decode,
        )  # fmt: skip
        engine.wait_ready()
    except BaseException as exc:
        if process is not None:
            process.close()
        if not isinstance(exc, VllmEngineError):
            raise
        error = str(exc)
    agree(error)
    assert engine is not None
    return engine
