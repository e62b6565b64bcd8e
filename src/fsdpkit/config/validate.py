"""Checks of a config that need no process group: ranges, finite floats, impossible
combinations, and what the world size allows. Every error names the key and the fix.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from fsdpkit.config.batch_split import batch_split
from fsdpkit.config.dims import parallel_dims
from fsdpkit.config.rl_rules import validate_rl
from fsdpkit.config.schedules import check_micro_batches, validate_pipeline
from fsdpkit.config.schema import DataConfig, ModelConfig, RunConfig
from fsdpkit.errors import ConfigError
from fsdpkit.precision_modes import MODES
from fsdpkit.strategies import strategy


def _positive(cfg: RunConfig) -> list[tuple[str, Any]]:
    return [
        ("data.seq_len", cfg.data.seq_len),
        ("train.steps", cfg.train.steps),
        ("train.micro_batch_size", cfg.train.micro_batch_size),
        ("train.grad_accum", cfg.train.grad_accum),
        ("train.eval_batches", cfg.train.eval_batches),
        ("train.loss_chunk_tokens", cfg.train.loss_chunk_tokens),
        ("parallel.blocks_per_unit", cfg.parallel.blocks_per_unit),
        ("parallel.tp", cfg.parallel.tp),
        ("parallel.cp", cfg.parallel.cp),
        ("parallel.timeout_s", cfg.parallel.timeout_s),
        ("activations.every", cfg.activations.every),
        ("checkpoint.keep", cfg.checkpoint.keep),
        ("logging.log_every", cfg.logging.log_every),
    ]


def validate(cfg: RunConfig) -> None:
    """Checks that need no process group; raises ConfigError naming the field."""
    for key, value in _positive(cfg):
        if value <= 0:
            raise ConfigError(f"{key} must be > 0, got {value}.")
    for key, value in [
        ("train.lr", cfg.train.lr),
        ("train.warmup_steps", cfg.train.warmup_steps),
        ("train.grad_clip", cfg.train.grad_clip),
        ("train.eval_every", cfg.train.eval_every),
        ("parallel.forward_prefetch", cfg.parallel.forward_prefetch),
        ("checkpoint.every", cfg.checkpoint.every),
        ("checkpoint.keep_every", cfg.checkpoint.keep_every),
    ]:
        if value < 0:
            raise ConfigError(f"{key} must be >= 0, got {value}.")
    if cfg.parallel.hang_timeout_s is not None and cfg.parallel.hang_timeout_s < 0:
        raise ConfigError(
            f"parallel.hang_timeout_s must be >= 0 (0: no stall watch; empty: 0.9 x "
            f"parallel.timeout_s), got {cfg.parallel.hang_timeout_s}."
        )
    if cfg.train.global_batch_size is not None and cfg.train.global_batch_size <= 0:
        raise ConfigError(
            f"train.global_batch_size must be > 0 (or empty), got {cfg.train.global_batch_size}."
        )
    _validate_floats(cfg)
    if not 0.0 <= cfg.data.val_fraction < 0.5:
        raise ConfigError(f"data.val_fraction must be in [0, 0.5), got {cfg.data.val_fraction}.")
    _validate_data(cfg)
    _validate_combinations(cfg)
    _validate_finetune(cfg)
    _validate_dpo(cfg)
    validate_rl(cfg)
    _validate_logging(cfg)
    _validate_async_tp(cfg)
    _validate_cp_attention(cfg)
    validate_pipeline(cfg)


def _validate_async_tp(cfg: RunConfig) -> None:
    """parallel.async_tp rewrites the compiled blocks' tensor-parallel collectives, so it
    needs both (the device is checked where the mesh is: fsdpkit.sharding.compile)."""
    if cfg.parallel.async_tp and (cfg.parallel.tp < 2 or not cfg.train.compile):
        raise ConfigError(
            f"parallel.async_tp = true overlaps tensor-parallel collectives with the matmuls "
            f"next to them inside compiled blocks, so it needs parallel.tp > 1 (got "
            f"{cfg.parallel.tp}) and train.compile = true (got {cfg.train.compile}). Set "
            "both, or parallel.async_tp = false."
        )


def _validate_cp_attention(cfg: RunConfig) -> None:
    """parallel.cp_attention = "ring" splits attention over cp ranks, causally over whole
    rows, in 2 x cp chunks (fsdpkit.sharding.context.ring)."""
    par = cfg.parallel
    if par.cp_attention != "ring":
        return
    if par.cp < 2:
        raise ConfigError(
            f'parallel.cp_attention = "ring" splits attention over the context-parallel '
            f"ranks, but parallel.cp = {par.cp}. Set parallel.cp > 1, or leave "
            'parallel.cp_attention = "ulysses".'
        )
    if cfg.data.seq_len % (2 * par.cp):
        raise ConfigError(
            f"data.seq_len = {cfg.data.seq_len} must be a multiple of 2 x parallel.cp = "
            f'{2 * par.cp} with parallel.cp_attention = "ring": each rank holds two equal '
            "chunks of every sequence (one early, one late) so causal attention's work is "
            "balanced."
        )
    if forced_sft(cfg.data) and cfg.data.pack and cfg.train.objective == "lm":
        raise ConfigError(
            'parallel.cp_attention = "ring" attends causally over each whole row, so it '
            "cannot keep packed SFT examples apart (data.format = sft, data.pack = true). "
            'Set data.pack = false, or parallel.cp_attention = "ulysses" (which applies '
            "the document mask)."
        )


def _validate_logging(cfg: RunConfig) -> None:
    steps = cfg.logging.profile_steps
    if not steps:
        return
    if len(steps) != 2 or not 1 <= steps[0] <= steps[1] <= cfg.train.steps:
        raise ConfigError(
            f"logging.profile_steps = {steps} must be [first, last] with 1 <= first <= last "
            f"<= train.steps ({cfg.train.steps}), e.g. logging.profile_steps=[5,6]; "
            "leave it empty to profile nothing."
        )


def _validate_finetune(cfg: RunConfig) -> None:
    lora = cfg.lora
    if lora.rank < 0 or lora.alpha <= 0 or not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(
            f"lora.rank ({lora.rank}) must be >= 0, lora.alpha ({lora.alpha}) > 0 and "
            f"lora.dropout ({lora.dropout}) in [0, 1)."
        )
    if lora.rank and not lora.targets:
        raise ConfigError(
            "lora.targets is empty, so lora.rank > 0 adds no adapter; name the layers, e.g. "
            'lora.targets=["q_proj","v_proj"], or use ["all-linear"].'
        )
    mode = cfg.precision.mode
    if lora.base_dtype == "bf16" and mode in MODES and not MODES[mode].low_precision:
        raise ConfigError(
            f"lora.base_dtype = 'bf16' needs bf16 compute, but precision.mode = {mode!r} "
            "computes in fp32: the bf16 base could not multiply fp32 activations. Use "
            "precision.mode = bf16 (the base is then stored in bf16 by default) or "
            "lora.base_dtype = auto."
        )
    if cfg.checkpoint.adapters_only and not (lora.rank or cfg.model.freeze):
        raise ConfigError(
            "checkpoint.adapters_only = true saves only the trainable parameters, but this "
            "run trains all of them (lora.rank = 0, model.freeze empty). Set lora.rank (or "
            "model.freeze), or checkpoint.adapters_only = false."
        )


def _validate_dpo(cfg: RunConfig) -> None:
    """[dpo] against the run: preference pairs need a data.path of pairs, and the
    reference is either a separate model or (under LoRA) the base with adapters off.
    Tensor and context parallelism are fine: the logits are gathered whole on every
    tp rank and cp sums each side's log-probs over its slices (fsdpkit.loss.dpo)."""
    dpo = cfg.dpo
    if dpo.beta <= 0 or dpo.simpo_gamma < 0:
        raise ConfigError(
            f"dpo.beta ({dpo.beta}) must be > 0 and dpo.simpo_gamma ({dpo.simpo_gamma}) >= 0."
        )
    if cfg.train.objective != "dpo":
        return
    if not cfg.data.path or cfg.data.mix:
        raise ConfigError(
            "train.objective = 'dpo' trains on preference pairs, so data.path must name a "
            "file or directory of {prompt, chosen, rejected} rows (data.mix is not "
            "supported for preference data); see docs/preference.md."
        )
    if dpo.reference and (cfg.lora.rank or dpo.loss == "simpo"):
        why = (
            "lora.rank > 0 uses the base with adapters off"
            if cfg.lora.rank
            else ("dpo.loss = 'simpo' is reference-free")
        )
        raise ConfigError(
            f"dpo.reference = {dpo.reference!r} names a separate reference model, but {why}, "
            "so it would never be read. Empty dpo.reference, or use dpo.loss = sigmoid / ipo "
            "with lora.rank = 0."
        )
    if cfg.train.compile or cfg.train.chunked_loss == "on":
        raise ConfigError(
            "train.objective = 'dpo' computes the full logits of each side once (its "
            "log-probs), so train.compile = true and train.chunked_loss = 'on' are not "
            "supported with it yet; set train.compile = false and train.chunked_loss = auto."
        )


def forced_sft(d: DataConfig) -> bool:
    """Whether the config itself says the data is SFT rows (auto may still find them)."""
    return d.format == "sft" or d.schema not in ("auto", "text")


def _validate_data(cfg: RunConfig) -> None:
    d = cfg.data
    if d.max_bytes is not None and d.max_bytes <= 0:
        raise ConfigError(f"data.max_bytes must be > 0 (or empty: all of it), got {d.max_bytes}.")
    if d.workers < 0:
        raise ConfigError(f"data.workers must be >= 0 (0: one per CPU core), got {d.workers}.")
    if d.path and d.mix:
        raise ConfigError(
            "data.path and data.mix both name the data; keep one (data.mix = "
            '["PATH@WEIGHT", ...] for several sources).'
        )
    if forced_sft(d) and not (d.path or d.mix):
        raise ConfigError(
            f"data.format = {d.format!r} / data.schema = {d.schema!r} needs data.path: SFT "
            "rows such as prompt/completion or messages (the built-in corpus is plain text)."
        )
    if d.format == "text" and d.schema not in ("auto", "text"):
        raise ConfigError(
            f"data.format = 'text' contradicts data.schema = {d.schema!r} (an SFT schema); "
            "drop one of them."
        )


def _validate_floats(cfg: RunConfig) -> None:
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            value = getattr(getattr(cfg, section.name), f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{section.name}.{f.name} must be a finite number, got {value}.")
    t = cfg.train
    for key, value, low, high in [
        ("train.min_lr_ratio", t.min_lr_ratio, 0.0, 1.0),
        ("train.beta1", t.beta1, 0.0, 0.999999),
        ("train.beta2", t.beta2, 0.0, 0.999999),
    ]:
        if not low <= value <= high:
            raise ConfigError(f"{key} must be in [{low}, {high:g}], got {value}.")
    if t.weight_decay < 0:
        raise ConfigError(f"train.weight_decay must be >= 0, got {t.weight_decay}.")


def _validate_combinations(cfg: RunConfig) -> None:
    p = cfg.parallel
    chosen = strategy(p.strategy)
    if cfg.offload.params and not chosen.allows_offload:
        raise ConfigError(
            f"offload.params = true cannot be combined with parallel.strategy = {p.strategy!r}: "
            "offloading needs parameters resharded after forward, which that strategy "
            "never does. Use parallel.strategy = 'full' or 'hybrid', or offload.params = false."
        )
    if cfg.offload.params and p.reshard_after_forward is False:
        raise ConfigError(
            "offload.params = true needs parameters resharded after forward; "
            "remove parallel.reshard_after_forward = false."
        )
    _validate_precision_levers(cfg)
    _validate_model_source(cfg.model)
    if cfg.model.factory is not None and ":" not in cfg.model.factory:
        raise ConfigError(
            f"model.factory = {cfg.model.factory!r} must look like 'package.module:function'."
        )
    if p.shard_degree is not None and not chosen.hybrid:
        raise ConfigError(
            f"parallel.shard_degree is only used by hybrid strategies, not {p.strategy!r}; "
            "remove it or set parallel.strategy = 'hybrid'."
        )
    if p.backward_prefetch < 1:
        raise ConfigError(
            f"parallel.backward_prefetch = {p.backward_prefetch}: FSDP2 always prefetches "
            "at least the next unit in backward (1, the default); use 1, or k > 1 to "
            "all-gather k units ahead."
        )
    raf = p.reshard_after_forward
    if isinstance(raf, int) and not isinstance(raf, bool) and raf < 1:
        raise ConfigError(f"parallel.reshard_after_forward = {raf} must be >= 1 (or true/false).")


_PRESET_SHAPE = (
    "n_layers",
    "dim",
    "n_heads",
    "n_kv_heads",
    "ffn_dim",
    "experts",
    "top_k",
    "vocab_size",
    "tie_embeddings",
)


def _validate_precision_levers(cfg: RunConfig) -> None:
    """Precision against the levers that depend on it: the fp16 scaler, selective
    checkpointing with fp32 norm units, the fused AdamW kernel under a scaler."""
    mode = cfg.precision.mode
    if mode in MODES and MODES[mode].scaler and cfg.precision.grad_scaler is False:
        raise ConfigError(
            f"precision.mode = {mode!r} without a gradient scaler underflows gradients. "
            "Set precision.grad_scaler = true (or leave it empty), or use bf16/fp32."
        )
    if cfg.activations.mode == "selective" and cfg.precision.norms_fp32:
        raise ConfigError(
            "activations.mode = 'selective' cannot be combined with precision.norms_fp32 = "
            "true: the norms become FSDP units inside each block, their hooks run other ops "
            "in the recompute than in forward, and selective checkpointing replays forward "
            "op by op. Use activations.mode = 'full' with norms_fp32, or norms_fp32 = false."
        )
    scaler = cfg.precision.grad_scaler
    if scaler is None:
        scaler = mode in MODES and MODES[mode].scaler
    if cfg.train.optimizer_impl == "fused" and scaler:
        raise ConfigError(
            "train.optimizer_impl = 'fused' cannot step under the fp16 gradient scaler: "
            "torch's fused AdamW fails with FSDP2's sharded scaler (found_inf of shape [1] "
            "against step counters of shape []). Use train.optimizer_impl = auto or "
            "foreach, or precision.mode = bf16 / fp32."
        )


def _validate_model_source(m: ModelConfig) -> None:
    if m.hf is None:
        return
    if m.factory is not None or m.init_from is not None:
        other = "model.factory" if m.factory is not None else "model.init_from"
        raise ConfigError(
            f"model.hf and {other} both name the model; keep one (model.hf is the weights "
            "and the architecture)."
        )
    shape = [k for k in _PRESET_SHAPE if getattr(m, k) is not None]
    if shape:
        raise ConfigError(
            f"model.{shape[0]} overrides a built-in preset's shape, but model.hf takes its "
            "shape from the directory's config.json; remove it, or edit config.json."
        )


def mesh_shape(cfg: RunConfig, *, world_size: int, local_world_size: int) -> tuple[int, int]:
    """(replicate degree, shard degree) of the data-parallel ranks ([Note: parallel
    dimensions] in fsdpkit.config.dims); hybrid strategies shard over
    ``parallel.shard_degree`` ranks, by default one node's data-parallel ranks."""
    dims = parallel_dims(cfg, world_size=world_size, local_world_size=local_world_size)
    return dims.replicate, dims.shard


def validate_for_world(cfg: RunConfig, *, world_size: int, local_world_size: int) -> None:
    """Checks that depend on the world size, run before any process group starts."""
    dims = parallel_dims(cfg, world_size=world_size, local_world_size=local_world_size)
    split = batch_split(cfg.train, dp_world=dims.dp)
    check_micro_batches(cfg, dp=dims.dp, micro_batches=split.grad_accum)
    shard = dims.fsdp_shard
    raf = cfg.parallel.reshard_after_forward
    if isinstance(raf, int) and not isinstance(raf, bool) and shard % raf:
        raise ConfigError(
            f"parallel.reshard_after_forward = {raf} must divide the shard group size "
            f"({shard} at world size {world_size}). Use a divisor of {shard}, or true/false."
        )
