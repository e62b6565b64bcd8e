"""The ``fsdp_config`` section of an Accelerate config -> fsdpkit settings.

Keys arrive normalized to their ``fsdp_`` names. FSDP1 (``fsdp_version: 1``) and FSDP2
semantics differ for ``fsdp_reshard_after_forward`` (a strategy name vs a bool); on a
conflict this follows the precedence Accelerate itself applies, and says so.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

from fsdpkit.migrate import fsdp1_args as fsdp1
from fsdpkit.migrate.outcome import MigrateError, Migration

Handler = Callable[[Migration, Any], None]


def _fsdp_handlers(version: int, policy: str | None) -> dict[str, Handler]:
    """fsdp_config key -> what it becomes (keys that need context are handled apart)."""

    def on(fn: Callable[..., Any], key: str) -> Handler:
        return lambda m, v: fn(m, v, key=key)

    return {
        "fsdp_offload_params": on(fsdp1.offload, "fsdp_offload_params"),
        "fsdp_backward_prefetch": on(fsdp1.backward_prefetch, "fsdp_backward_prefetch"),
        "fsdp_backward_prefetch_policy": on(
            fsdp1.backward_prefetch, "fsdp_backward_prefetch_policy"
        ),
        "fsdp_forward_prefetch": on(fsdp1.forward_prefetch, "fsdp_forward_prefetch"),
        "fsdp_limit_all_gathers": on(fsdp1.limit_all_gathers, "fsdp_limit_all_gathers"),
        "fsdp_use_orig_params": on(fsdp1.use_orig_params, "fsdp_use_orig_params"),
        "fsdp_sync_module_states": on(fsdp1.sync_module_states, "fsdp_sync_module_states"),
        "fsdp_cpu_ram_efficient_loading": on(
            fsdp1.ram_efficient_loading, "fsdp_cpu_ram_efficient_loading"
        ),
        "fsdp_state_dict_type": on(fsdp1.state_dict_type, "fsdp_state_dict_type"),
        "fsdp_activation_checkpointing": on(
            fsdp1.activation_checkpointing, "fsdp_activation_checkpointing"
        ),
        "fsdp_transformer_layer_cls_to_wrap": lambda m, v: fsdp1.block_classes(
            m,
            v,
            key="fsdp_transformer_layer_cls_to_wrap",
            ignored_by=""
            if policy in (None, "TRANSFORMER_BASED_WRAP")
            else f"Accelerate ({policy})",
        ),
        "fsdp_min_num_params": lambda m, v: m.drop(
            f"fsdp_min_num_params: {v}",
            "no equivalent: units are blocks, not parameter counts"
            + (
                "" if policy == "SIZE_BASED_WRAP" else f" (and Accelerate ignores it with {policy})"
            ),
        ),
        "fsdp_activation_checkpointing_offload": lambda m, v: m.drop(
            f"fsdp_activation_checkpointing_offload: {v}",
            "no equivalent: fsdpkit keeps checkpointed inputs on the device",
        ),
        "fsdp_ignored_modules": lambda m, v: m.drop(
            f"fsdp_ignored_modules: {v}",
            "no equivalent: every parameter is sharded; freeze modules in your factory instead",
        ),
    }


_CONTEXT_KEYS = {
    "fsdp_version", "fsdp_sharding_strategy", "fsdp_reshard_after_forward", "fsdp_auto_wrap_policy",
}  # fmt: skip


def _strategy(m: Migration, fsdp: dict[str, Any], version: int) -> None:
    """fsdp_sharding_strategy (FSDP1, deprecated) vs fsdp_reshard_after_forward (a
    strategy name in FSDP1, a bool in FSDP2); Accelerate's precedence on conflict."""
    strategy_key, raf_key = "fsdp_sharding_strategy", "fsdp_reshard_after_forward"
    has_strategy, has_raf = strategy_key in fsdp, raf_key in fsdp
    raf = fsdp.get(raf_key)
    from_raf = None
    if has_raf:
        if isinstance(raf, bool) or str(raf).lower() in ("true", "false"):
            from_raf = fsdp1.reshard_bool(m, raf, key=raf_key)
        else:
            from_raf = fsdp1.sharding(m, raf, key=raf_key)
    if has_strategy and (version == 1 or not has_raf):
        chosen = fsdp1.sharding(m, fsdp[strategy_key], key=strategy_key)
        if from_raf is not None and from_raf != chosen:
            note_conflict(
                m,
                f"{strategy_key} ({chosen}) and {raf_key} ({from_raf}) disagree; "
                f"Accelerate's FSDP1 path uses {strategy_key}, so does this config",
            )
    elif has_strategy and from_raf is not None:
        note_conflict(m, f"{strategy_key} is ignored with fsdp_version 2; {raf_key} decides")
    if not has_strategy and not has_raf:
        m.set("parallel.strategy", "full", "(Accelerate default: FULL_SHARD / reshard)")


def note_conflict(m: Migration, text: str) -> None:
    m.warnings.append(f"conflict: {text}")


def convert_fsdp_section(m: Migration, fsdp: dict[str, Any]) -> None:
    version = int(fsdp.get("fsdp_version", 1))
    if version not in (1, 2):
        raise MigrateError(f"fsdp_version = {fsdp['fsdp_version']!r} must be 1 or 2.")
    if version == 1:
        m.drop(
            "fsdp_version: 1",
            "meaning changed: fsdpkit always runs FSDP2 (fully_shard: per-parameter DTensor "
            "shards instead of flat parameters; same memory, resharding-friendly checkpoints)",
        )
    _strategy(m, fsdp, version)
    policy = None
    if "fsdp_auto_wrap_policy" in fsdp:
        policy = fsdp1.wrap_policy(m, fsdp["fsdp_auto_wrap_policy"], key="fsdp_auto_wrap_policy")
    if policy == "TRANSFORMER_BASED_WRAP" and "fsdp_transformer_layer_cls_to_wrap" not in fsdp:
        m.drop(
            "fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP",
            "without a class list Accelerate wraps the model's _no_split_modules; fsdpkit "
            "detects the repeated block class (name it in parallel.block_classes to choose)",
        )
    handlers = _fsdp_handlers(version, policy)
    for key, value in fsdp.items():
        if key in _CONTEXT_KEYS:
            continue
        handler = handlers.get(key)
        if handler is None:
            close = difflib.get_close_matches(key, sorted(handlers), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else ""
            m.warnings.append(
                f"unknown fsdp_config key {key}{hint}: Accelerate ignores it; so does this config"
            )
            continue
        handler(m, value)
    _fsdp_conflicts(m, fsdp, version)


def _fsdp_conflicts(m: Migration, fsdp: dict[str, Any], version: int) -> None:
    if version == 2:
        for key in ("fsdp_backward_prefetch", "fsdp_use_orig_params", "fsdp_sync_module_states"):
            if key in fsdp:
                note_conflict(
                    m, f"{key} is an FSDP1 setting; Accelerate ignores it with fsdp_version 2"
                )
        if fsdp1.boolean(fsdp.get("fsdp_forward_prefetch", False), key="fsdp_forward_prefetch"):
            note_conflict(m, "Accelerate refuses fsdp_forward_prefetch with fsdp_version 2")
    efficient = fsdp1.boolean(fsdp.get("fsdp_cpu_ram_efficient_loading", False), key="x")
    sync = fsdp.get("fsdp_sync_module_states")
    if version == 1 and efficient and sync is not None and not fsdp1.boolean(sync, key="x"):
        note_conflict(
            m,
            "fsdp_cpu_ram_efficient_loading needs fsdp_sync_module_states: true in "
            "Accelerate (its launcher refuses this file); fsdpkit needs neither",
        )
    fsdp1.check_offload(
        m, offload_key="fsdp_offload_params: true", strategy_key="the sharding strategy"
    )
