"""``parallel.auto``: let the planner pick the parallel settings before launch.

The launcher runs the recommender once for the world size and the detected (or
given) device memory, prints its choice, and hands the workers the chosen keys as
overrides; joined workers (torchrun) compute the same deterministic choice.
"""

from __future__ import annotations

from typing import Any

from fsdpkit.cli.configargs import tokenizer_vocab
from fsdpkit.config import RunConfig
from fsdpkit.errors import UserError


def _detected_device() -> str:
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return f"{props.name.lower().replace(' ', '-')}:{props.total_memory}"
    return ""


def _device(cfg: RunConfig, *, local_world_size: int) -> Any:
    from fsdpkit.planner.devices import host_memory_bytes, parse_device

    text = cfg.parallel.device_mem or _detected_device()
    if text:
        try:
            return parse_device(text, what="parallel.device_mem")
        except UserError:
            if cfg.parallel.device_mem:
                raise
            return parse_device(text.split(":", 1)[1], what="parallel.device_mem")
    share = host_memory_bytes() // max(local_world_size, 1)
    return parse_device(f"cpu:{share}", what="parallel.device_mem")


def auto_overrides(cfg: RunConfig, *, world_size: int, local_world_size: int) -> list[str]:
    """The recommended config keys as ``key=value`` overrides (empty if auto is off)."""
    if not cfg.parallel.auto:
        return []
    from fsdpkit.config import _toml_value
    from fsdpkit.planner import recommend

    rec = recommend(
        cfg,
        world_size=world_size,
        device=_device(cfg, local_world_size=local_world_size),
        ranks_per_node=local_world_size,
        vocab_size=tokenizer_vocab(cfg),
    )
    if rec.best is None:
        raise UserError(
            f"parallel.auto: no configuration of this model fits on {world_size} ranks of this "
            "device. Run `fsdpkit plan --recommend` with the same config to see the closest "
            "ones, then add ranks, use a bigger device, or shrink the batch or sequence."
        )
    return [f"{k}={_toml_value(v)}" for k, v in rec.best.changes.items()] + ["parallel.auto=false"]
