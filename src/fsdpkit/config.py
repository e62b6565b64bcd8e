"""The run configuration: typed, documented, validated data (no environment reads).

A run is described by a TOML file whose sections are the dataclasses below, plus
dotted ``key=value`` overrides (``train.steps=50``). Every field has a docstring under
it; ``fsdpkit train --help-config`` prints them. Errors name the key and suggest the
closest valid one.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import itertools
import math
import textwrap
import tomllib
import types
import typing
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

from fsdpkit.errors import UserError

Strategy = Literal["full", "grad_op", "hybrid", "hybrid_grad_op", "replicate"]
PrecisionMode = Literal["auto", "fp32", "bf16", "bf16-pure", "fp16"]
ACMode = Literal["none", "full", "every"]
Schedule = Literal["cosine", "constant", "linear"]


class ConfigError(UserError, ValueError):
    """A config value is wrong; the message names the key and the fix."""


@dataclass
class ModelConfig:
    preset: str = "tiny"
    """Built-in Llama-style shape: tiny, llama3-1b, llama3-3b, llama3-8b, llama3-70b or
    llama3-405b."""
    factory: str | None = None
    """Your own model instead of a preset: "package.module:function" returning an nn.Module
    (or (module, loss_fn)); called with no arguments."""
    n_layers: int | None = None
    """Override the preset's number of blocks."""
    dim: int | None = None
    """Override the preset's hidden size."""
    n_heads: int | None = None
    """Override the preset's query heads."""
    n_kv_heads: int | None = None
    """Override the preset's key/value heads."""
    ffn_dim: int | None = None
    """Override the preset's SwiGLU hidden size."""
    vocab_size: int | None = None
    """Override the vocabulary size (default: the tokenizer's)."""
    tie_embeddings: bool | None = None
    """Override whether the output head shares the embedding."""
    meta_init: bool = True
    """Build on the meta device and materialize only local shards (no rank holds the full model)."""
    init_from: str | None = None
    """Directory of HF-layout safetensors to initialize the weights from."""


@dataclass
class DataConfig:
    path: str | None = None
    """Text file, directory, glob or .jsonl; empty = the built-in corpus (Python's
    standard-library sources)."""
    text_field: str = "text"
    """Field holding the text in JSONL records."""
    tokenizer: str | None = None
    """Directory (or file) with a Hugging Face tokenizer.json; empty = byte-level (vocab 256)."""
    seq_len: int = 128
    """Tokens per training sequence (packed, fixed length)."""
    val_fraction: float = 0.02
    """Share of the token stream held out for validation."""
    max_bytes: int = 4_000_000
    """Read at most this many bytes of text (bounds start-up time on huge corpora)."""


@dataclass
class TrainConfig:
    steps: int = 300
    """Optimizer steps to run."""
    seed: int = 0
    """Seed for weights, data order and dropout-free determinism."""
    micro_batch_size: int = 4
    """Sequences per rank per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (only the last one reduces gradients)."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final LR as a fraction of the peak (cosine/linear)."""
    warmup_steps: int = 20
    """Linear warm-up steps."""
    schedule: Schedule = "cosine"
    """LR schedule after warm-up: cosine, linear or constant."""
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to norms and biases)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables."""
    eval_every: int = 100
    """Evaluate on the validation split every N steps (and at the end); 0 disables."""
    eval_batches: int = 4
    """Micro-batches per rank in one evaluation."""
    sample_tokens: int = 120
    """Tokens of sample text generated at the end for the built-in LM; 0 disables."""


@dataclass
class ParallelConfig:
    strategy: Strategy = "full"
    """full (ZeRO-3), grad_op (ZeRO-2), hybrid (HSDP), hybrid_grad_op, replicate (DDP-like)."""
    shard_degree: int | None = None
    """Ranks per shard group for hybrid strategies (replicas = world / shard_degree);
    empty = ranks per node."""
    reshard_after_forward: bool | int | None = None
    """Override the strategy's resharding: true, false, or an int to reshard to a smaller
    group (must divide the shard group size)."""
    block_classes: list[str] = field(default_factory=list)
    """Class names of the blocks to shard one per unit; empty = detect automatically."""
    blocks_per_unit: int = 1
    """Blocks grouped into one FSDP unit."""
    accum_keep_unsharded: bool = False
    """During gradient accumulation keep parameters unsharded between micro-batches
    (fewer all-gathers, but full parameters stay in memory)."""
    timeout_s: float = 600.0
    """Collective timeout in seconds; a rank stuck longer fails the run with the step."""
    auto: bool = False
    """Let the planner choose strategy, mesh, resharding, activation checkpointing, offload
    and micro-batch size for this world size and device (as `fsdpkit plan --recommend`)."""
    device_mem: str | None = None
    """Device memory per rank for parallel.auto: a size (80GiB), a device name (h100) or
    NAME:SIZE; empty = detected (GPU memory, or host memory / local ranks on CPU)."""


@dataclass
class PrecisionConfig:
    mode: PrecisionMode = "auto"
    """fp32, bf16 (bf16 compute, fp32 reduce), bf16-pure, fp16 (+ grad scaler);
    auto = bf16 on GPUs that support it, else fp32."""
    norms_fp32: bool = False
    """Keep norm layers' parameters and compute in fp32 (own FSDP units)."""
    grad_scaler: bool | None = None
    """Dynamic loss scaling; empty = on for fp16, off otherwise. fp16 requires it."""


@dataclass
class OffloadConfig:
    params: bool = False
    """Keep sharded parameters, gradients and the optimizer step on the CPU."""


@dataclass
class ActivationsConfig:
    mode: ACMode = "none"
    """Activation checkpointing: none, full (every block) or every (every k-th block)."""
    every: int = 2
    """With mode = every: checkpoint one block in this many."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Save every N steps (and at the end when > 0); 0 disables periodic saves."""
    keep: int = 2
    """Keep the newest K complete checkpoints."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this; 0 disables."""
    async_save: bool = False
    """Write checkpoints in the background while training continues."""
    resume: str = "auto"
    """auto (newest complete checkpoint in the run dir), never, or a checkpoint path."""
    save_on_sigterm: bool = True
    """On SIGTERM (preemption) checkpoint the current step before exiting."""


@dataclass
class LoggingConfig:
    run_dir: str = "runs/default"
    """Directory for the resolved config, metrics.jsonl, checkpoints and plots."""
    log_every: int = 1
    """Write metrics every N steps."""
    progress: Literal["auto", "bar", "lines", "none"] = "auto"
    """Progress display on rank 0: auto = a bar on a terminal, plain lines otherwise."""


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    activations: ActivationsConfig = field(default_factory=ActivationsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {
    f.name: typing.get_type_hints(RunConfig)[f.name] for f in dataclasses.fields(RunConfig)
}


# ---------------------------------------------------------------------------- parsing


def _suggest(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else f" Valid: {', '.join(options)}."


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "empty"
    return getattr(tp, "__name__", str(tp)) if typing.get_origin(tp) is None else str(tp)


def _is_union(tp: Any) -> bool:
    return isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union


def _coerce_union(key: str, value: Any, tp: Any) -> Any:
    if value is None and type(None) in typing.get_args(tp):
        return None
    for arg in typing.get_args(tp):
        if arg is type(None):
            continue
        try:
            return _coerce(key, value, arg)
        except ConfigError:
            pass
    raise _wrong_type(key, value, tp)


def _coerce_literal(key: str, value: Any, tp: Any) -> Any:
    if value in typing.get_args(tp):
        return value
    options = [str(a) for a in typing.get_args(tp)]
    raise ConfigError(f"{key} = {value!r} is not a valid choice.{_suggest(str(value), options)}")


def _coerce_list(key: str, value: Any, tp: Any) -> Any:
    (item_tp,) = typing.get_args(tp)
    if isinstance(value, str):  # key=a,b on the command line
        value = [v for v in value.split(",") if v]
    if not isinstance(value, list):
        raise _wrong_type(key, value, tp)
    return [_coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]


def _wrong_type(key: str, value: Any, tp: Any) -> ConfigError:
    return ConfigError(
        f"{key} = {value!r} has the wrong type: expected {_type_name(tp)}. "
        f"Fix the value in the TOML file or the override (e.g. {key}=<{_type_name(tp)}>)."
    )


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; returns it (ints widened to float)."""
    if _is_union(tp):
        return _coerce_union(key, value, tp)
    if typing.get_origin(tp) is Literal:
        return _coerce_literal(key, value, tp)
    if typing.get_origin(tp) is list:
        return _coerce_list(key, value, tp)
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if tp is float and is_number:
        return float(value)
    if (tp is int and is_number and isinstance(value, int)) or (
        tp in (str, bool) and isinstance(value, tp)
    ):
        return value
    raise _wrong_type(key, value, tp)


def _build_section(name: str, cls: type, values: dict[str, Any], *, source: str) -> Any:
    hints = typing.get_type_hints(cls)
    known = list(hints)
    kwargs = {}
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(
                f"unknown key {name}.{key} in {source}.{_suggest(key, known)} "
                "Run `fsdpkit train --help-config` for every key."
            )
        kwargs[key] = _coerce(f"{name}.{key}", value, hints[key])
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value); the value is read as TOML, else as a string."""
    if "=" not in text:
        raise ConfigError(
            f"override {text!r} is not key=value. Write e.g. train.steps=50 "
            "(dotted key, '=', value)."
        )
    key, raw = text.split("=", 1)
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"] if raw else None
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip().split("."), value


def merge_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply dotted overrides to a nested dict (copy)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for text in overrides:
        path, value = parse_override(text)
        if len(path) != 2:
            raise ConfigError(
                f"override {text!r}: keys are section.field (e.g. train.steps=50); "
                f"sections: {', '.join(SECTIONS)}."
            )
        out.setdefault(path[0], {})
        if not isinstance(out[path[0]], dict):
            raise ConfigError(f"{path[0]} is a section, not a value")
        out[path[0]][path[1]] = value
    return out


def from_dict(data: dict[str, Any], *, source: str = "the config") -> RunConfig:
    """Build and validate a RunConfig from nested section dicts."""
    sections = {}
    for name, values in data.items():
        if name not in SECTIONS:
            raise ConfigError(
                f"unknown section [{name}] in {source}.{_suggest(name, list(SECTIONS))}"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"[{name}] in {source} must be a table of key = value lines")
        sections[name] = _build_section(name, SECTIONS[name], values, source=source)
    cfg = RunConfig(**sections)
    validate(cfg)
    return cfg


def load(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a TOML file (optional) and apply overrides."""
    data: dict[str, Any] = {}
    source = "the command line"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(
                f"config file {str(p)!r} does not exist. Pass an existing TOML file, or "
                "none to use the built-in default."
            )
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {exc}") from None
        source = str(p)
    return from_dict(merge_overrides(data, overrides or []), source=source)


def to_toml(cfg: RunConfig) -> str:
    """The resolved config as TOML that ``load`` reads back to an equal RunConfig."""
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is None:
                lines.append(f"# {key} = (empty)")
            else:
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


# ------------------------------------------------------------------------- validation


def _positive(cfg: RunConfig) -> list[tuple[str, Any]]:
    return [
        ("data.seq_len", cfg.data.seq_len),
        ("data.max_bytes", cfg.data.max_bytes),
        ("train.steps", cfg.train.steps),
        ("train.micro_batch_size", cfg.train.micro_batch_size),
        ("train.grad_accum", cfg.train.grad_accum),
        ("train.eval_batches", cfg.train.eval_batches),
        ("parallel.blocks_per_unit", cfg.parallel.blocks_per_unit),
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
        ("checkpoint.every", cfg.checkpoint.every),
        ("checkpoint.keep_every", cfg.checkpoint.keep_every),
    ]:
        if value < 0:
            raise ConfigError(f"{key} must be >= 0, got {value}.")
    _validate_floats(cfg)
    if not 0.0 <= cfg.data.val_fraction < 0.5:
        raise ConfigError(f"data.val_fraction must be in [0, 0.5), got {cfg.data.val_fraction}.")
    _validate_combinations(cfg)


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
    if cfg.offload.params and p.strategy in ("grad_op", "hybrid_grad_op", "replicate"):
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
    if cfg.precision.mode == "fp16" and cfg.precision.grad_scaler is False:
        raise ConfigError(
            "precision.mode = 'fp16' without a gradient scaler underflows gradients. "
            "Set precision.grad_scaler = true (or leave it empty), or use bf16/fp32."
        )
    if cfg.model.factory is not None and ":" not in cfg.model.factory:
        raise ConfigError(
            f"model.factory = {cfg.model.factory!r} must look like 'package.module:function'."
        )
    if p.shard_degree is not None and p.strategy not in ("hybrid", "hybrid_grad_op"):
        raise ConfigError(
            f"parallel.shard_degree is only used by hybrid strategies, not {p.strategy!r}; "
            "remove it or set parallel.strategy = 'hybrid'."
        )
    raf = p.reshard_after_forward
    if isinstance(raf, int) and not isinstance(raf, bool) and raf < 1:
        raise ConfigError(f"parallel.reshard_after_forward = {raf} must be >= 1 (or true/false).")


def mesh_shape(cfg: RunConfig, *, world_size: int, local_world_size: int) -> tuple[int, int]:
    """(replicate degree, shard degree) for this strategy at this world size."""
    p = cfg.parallel
    if p.strategy == "replicate":
        return world_size, 1
    if p.strategy in ("full", "grad_op"):
        return 1, world_size
    shard = p.shard_degree or local_world_size
    if shard < 1 or world_size % shard:
        raise ConfigError(
            f"parallel.shard_degree = {shard} does not divide the world size {world_size}: "
            "the mesh is (replicas x shard_degree) and must multiply to the world size. "
            f"Pick a divisor of {world_size}."
        )
    return world_size // shard, shard


def validate_for_world(cfg: RunConfig, *, world_size: int, local_world_size: int) -> None:
    """Checks that depend on the world size, run before any process group starts."""
    _, shard = mesh_shape(cfg, world_size=world_size, local_world_size=local_world_size)
    raf = cfg.parallel.reshard_after_forward
    if isinstance(raf, int) and not isinstance(raf, bool) and shard % raf:
        raise ConfigError(
            f"parallel.reshard_after_forward = {raf} must divide the shard group size "
            f"({shard} at world size {world_size}). Use a divisor of {shard}, or true/false."
        )


# ------------------------------------------------------------------------------- docs


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under each field of a config dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def describe() -> str:
    """Every section and field with its type, default and doc (for --help-config)."""
    defaults = RunConfig().to_dict()
    out = []
    for section, cls in SECTIONS.items():
        out.append(f"[{section}]")
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        for key, tp in hints.items():
            default = defaults[section][key]
            shown = "(empty)" if default is None else _toml_value(default)
            out.append(f"  {section}.{key} = {shown}    ({_type_name(tp)})")
            out.append(f"      {docs.get(key, '')}")
        out.append("")
    return "\n".join(out)
