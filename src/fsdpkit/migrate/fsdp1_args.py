"""FSDP1 concepts in fsdpkit terms: one function per FSDP1 setting, shared by the
Accelerate converter and the FSDP1-constructor converter.

Each takes the raw input value and the name it had in the input (for messages),
validates it (MigrateError naming the key, with a did-you-mean), and records fsdpkit
settings or a "no equivalent" note on a ``Migration``.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Callable
from typing import Any

from fsdpkit.migrate.outcome import MigrateError, Migration
from fsdpkit.precision import PRESETS
from fsdpkit.strategies import STRATEGIES

# torch.distributed.fsdp.ShardingStrategy: name -> (value, fsdpkit strategy, note)
SHARDING: dict[str, tuple[int, str, str]] = {
    "FULL_SHARD": (1, "full", ""),
    "SHARD_GRAD_OP": (
        2,
        "grad_op",
        "",
    ),
    "NO_SHARD": (
        3,
        "replicate",
        "meaning changed: FSDP1 NO_SHARD was DDP-like; fsdpkit runs FSDP2 on a (world x 1) "
        "mesh: full copies, all-reduced gradients, same memory",
    ),
    "HYBRID_SHARD": (
        4,
        "hybrid",
        "shards within each node and replicates across nodes (parallel.shard_degree "
        "defaults to the ranks per node, as FSDP1's default hybrid groups)",
    ),
    "_HYBRID_SHARD_ZERO2": (
        5,
        "hybrid_grad_op",
        "hybrid without resharding after forward (ZeRO-2 inside a node)",
    ),
}
SHARDING_ALIASES = {"HYBRID_SHARD_ZERO2": "_HYBRID_SHARD_ZERO2"}
BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
STATE_DICT_TYPES = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")
_TRUE = {"true", "yes", "1", "on"}
_FALSE = {"false", "no", "0", "off", "none", ""}


def enum_name(value: Any, choices: typing.Iterable[str], *, key: str) -> str:
    """``value`` as one of ``choices``: a name, "Enum.NAME", or a 1-based index (as
    torch's enums and Accelerate number them)."""
    options = list(choices)
    text = str(value).strip()
    if (isinstance(value, int) and not isinstance(value, bool)) or text.isdigit():
        index = int(text) - 1
        if 0 <= index < len(options):
            return options[index]
    name = text.rsplit(".", 1)[-1].upper()
    name = SHARDING_ALIASES.get(name, name)
    if name in options:
        return name
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]}?" if close else ""
    raise MigrateError(
        f"{key} = {value!r} is not one of {', '.join(o.lstrip('_') for o in options)}.{hint} "
        "Fix the value in the input and run fsdpkit migrate again."
    )


def boolean(value: Any, *, key: str) -> bool:
    """YAML/JSON booleans and the strings Accelerate's launcher accepts."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise MigrateError(f"{key} = {value!r} is not a boolean (true or false).")


def sharding(m: Migration, value: Any, *, key: str) -> str:
    """FSDP1 ShardingStrategy -> parallel.strategy; returns the fsdpkit strategy."""
    name = enum_name(value, SHARDING, key=key)
    _, strategy, note = SHARDING[name]
    m.set("parallel.strategy", strategy, f"{key}: {name.lstrip('_')}", note)
    return strategy


def reshard_bool(m: Migration, value: Any, *, key: str) -> str:
    """FSDP2's reshard_after_forward bool -> full (true) or grad_op (false)."""
    strategy = "full" if boolean(value, key=key) else "grad_op"
    m.set("parallel.strategy", strategy, f"{key}: {str(value).lower()}")
    return strategy


def offload(m: Migration, value: Any, *, key: str) -> None:
    enabled = boolean(value, key=key)
    m.set(
        "offload.params",
        enabled,
        f"{key}: {str(value).lower()}",
        "FSDP2 CPUOffloadPolicy: parameters, gradients and the optimizer step on the CPU"
        if enabled
        else "",
    )


def block_classes(m: Migration, value: Any, *, key: str, ignored_by: str = "") -> None:
    """transformer_layer_cls (a comma string, a list, or class objects' names)."""
    if isinstance(value, str):
        names = [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, list | tuple | set):
        names = [str(v).rsplit(".", 1)[-1].strip("'<>\" ") for v in value]
    else:
        raise MigrateError(f"{key} = {value!r} must be a class name or a list of class names.")
    note = "fsdpkit shards one unit per block of these classes (detected automatically if empty)"
    if ignored_by:
        m.set(
            "parallel.block_classes",
            names,
            f"{key}: {value}",
            f"ignored by {ignored_by}",
            commented=True,
        )
    else:
        m.set("parallel.block_classes", names, f"{key}: {value}", note)


def backward_prefetch(m: Migration, value: Any, *, key: str) -> None:
    name = "NO_PREFETCH" if value is None else enum_name(value, BACKWARD_PREFETCH, key=key)
    note = {
        "BACKWARD_PRE": "FSDP2 always prefetches the next unit's all-gather in backward "
        "(the BACKWARD_PRE overlap); no setting",
        "BACKWARD_POST": "no equivalent: FSDP2 prefetches before the current unit's gradient "
        "computation (BACKWARD_PRE order)",
        "NO_PREFETCH": "no equivalent: FSDP2 always prefetches one unit ahead in backward",
    }[name]
    m.drop(f"{key}: {name}", note)


_FLAG_NOTES: dict[str, tuple[str, str]] = {
    "forward_prefetch": (
        "FSDP2 issues the next unit's all-gather early on its own in forward (implicit "
        "prefetching); no setting",
        "FSDP2 default; no setting",
    ),
    "limit_all_gathers": (
        "FSDP2 always bounds in-flight all-gathers (memory-safe without a rate limiter); "
        "no setting",
        "no equivalent: FSDP2 cannot be unlimited; nothing to do",
    ),
    "use_orig_params": (
        "FSDP2 always exposes the original parameters (one DTensor each); no setting",
        "FSDP2 always exposes the original parameters (one DTensor each); no setting. "
        "Meaning changed: the optimizer now sees per-parameter tensors, so per-parameter "
        "groups (no weight decay on norms) work",
    ),
    "sync_module_states": (
        "not needed: every rank initializes identically (per-parameter seeded init from "
        "train.seed, or model.init_from read by every rank)",
    )
    * 2,
}


def _flag(concept: str) -> Callable[..., None]:
    """A boolean FSDP1 setting with no fsdpkit key: validated, noted as dropped."""
    on, off = _FLAG_NOTES[concept]

    def handle(m: Migration, value: Any, *, key: str) -> None:
        enabled = boolean(value, key=key)
        m.drop(f"{key}: {str(enabled).lower()}", on if enabled else off)

    handle.__name__ = concept
    return handle


forward_prefetch = _flag("forward_prefetch")
limit_all_gathers = _flag("limit_all_gathers")
use_orig_params = _flag("use_orig_params")
sync_module_states = _flag("sync_module_states")


def ram_efficient_loading(m: Migration, value: Any, *, key: str) -> None:
    enabled = boolean(value, key=key)
    m.set(
        "model.meta_init",
        True,
        f"{key}: {str(enabled).lower()}",
        "fsdpkit builds on the meta device and each rank reads only its own shard of "
        "model.init_from (no rank holds the full model)"
        if enabled
        else "meaning changed: fsdpkit always builds on the meta device (cheaper, same weights)",
    )


def state_dict_type(m: Migration, value: Any, *, key: str) -> None:
    name = enum_name(value, STATE_DICT_TYPES, key=key)
    note = {
        "SHARDED_STATE_DICT": "fsdpkit checkpoints are sharded DCP (loadable at any world size)",
        "FULL_STATE_DICT": "meaning changed: fsdpkit saves sharded DCP checkpoints; export one "
        "file with `fsdpkit ckpt export CKPT --format torch` (or --format hf)",
        "LOCAL_STATE_DICT": "no equivalent: fsdpkit saves sharded DCP checkpoints "
        "(per-rank flat shards cannot be resharded)",
    }[name]
    m.drop(f"{key}: {name}", note + ". To start from an FSDP1 checkpoint, set model.init_from")


def activation_checkpointing(m: Migration, value: Any, *, key: str) -> None:
    enabled = boolean(value, key=key)
    m.set(
        "activations.mode",
        "full" if enabled else "none",
        f"{key}: {str(enabled).lower()}",
        "every block unit recomputes its activations in backward" if enabled else "",
    )


def wrap_policy(m: Migration, value: Any, *, key: str) -> str:
    """TRANSFORMER_BASED_WRAP / SIZE_BASED_WRAP / NO_WRAP -> notes (blocks are classes)."""
    name = enum_name(value, ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"), key=key)
    if name == "SIZE_BASED_WRAP":
        m.drop(
            f"{key}: {name}",
            "meaning changed: fsdpkit makes units from repeated blocks (detected, or "
            "parallel.block_classes), not from parameter counts",
        )
    elif name == "NO_WRAP":
        m.drop(
            f"{key}: {name}",
            "meaning changed: NO_WRAP made the whole model one unit (all parameters gathered "
            "at once); fsdpkit shards per block, which needs less memory",
        )
    return name


def mixed_precision_dtypes(m: Migration, param: str, reduce: str, *, source: str) -> None:
    """FSDP MixedPrecision(param_dtype, reduce_dtype) -> the matching precision preset."""

    wanted = (
        _dtype(param, key=f"{source} param_dtype"),
        _dtype(reduce, key=f"{source} reduce_dtype"),
    )
    for preset in PRESETS.values():
        if (str(preset.param_dtype), str(preset.reduce_dtype)) == wanted:
            m.set("precision.mode", preset.name, f"{source}: param {param}, reduce {reduce}")
            return
    raise MigrateError(
        f"{source}: param_dtype {param} with reduce_dtype {reduce} has no fsdpkit preset "
        "(fp32, bf16 = bf16 params + fp32 reduce, bf16-pure, fp16 = fp16 params + fp32 "
        "reduce). Pick the closest one and set precision.mode by hand."
    )


_DTYPES = {
    "float32": "torch.float32", "fp32": "torch.float32", "float": "torch.float32",
    "bfloat16": "torch.bfloat16", "bf16": "torch.bfloat16",
    "float16": "torch.float16", "fp16": "torch.float16", "half": "torch.float16",
}  # fmt: skip


def _dtype(value: Any, *, key: str) -> str:
    text = str(value).strip().removeprefix("torch.").lower()
    if text in _DTYPES:
        return _DTYPES[text]
    raise MigrateError(f"{key} = {value!r} is not a dtype (float32, bfloat16, float16).")


def check_offload(m: Migration, *, offload_key: str, strategy_key: str) -> None:
    """FSDP1 allowed CPU offload with any strategy; FSDP2 offloading needs parameters
    resharded after forward (fsdpkit's config refuses the rest)."""
    strategy = m.value("parallel.strategy")
    if m.value("offload.params") and not STRATEGIES[str(strategy)].allows_offload:
        raise MigrateError(
            f"{offload_key} with {strategy_key} = {strategy} (never resharded after forward) "
            "has no FSDP2 equivalent: offloading needs parameters resharded after forward. "
            f"Change {strategy_key} to FULL_SHARD or HYBRID_SHARD, or turn {offload_key} off, "
            "then run fsdpkit migrate again."
        )
