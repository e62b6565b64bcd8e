"""``resolve``: the one place a run's final config is decided.

Load the file and overrides, let ``parallel.auto`` apply the planner's recommendation
for this world size, and check what the world size allows. The launcher (before any
process starts) and every worker (torchrun / SLURM joins, or spawned by the launcher)
call it with the same arguments and get the same config: the recommendation is
deterministic. The resolved config has ``parallel.auto = false`` and the chosen values
written out, ``parallel.accum_sync = auto`` decided too ([Note: accum_sync auto]), so
its ``config.toml`` reproduces the run without planning again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpkit.config.io import load, with_changes
from fsdpkit.config.schema import RunConfig
from fsdpkit.config.validate import validate_for_world


@dataclass(frozen=True)
class Resolved:
    """A run's final config and what ``parallel.auto`` changed to get it."""

    config: RunConfig
    auto_changes: dict[str, Any] | None = None
    """Dotted keys ``parallel.auto`` set (empty: it kept the config as given); None
    when parallel.auto is off."""
    auto_note: str | None = None
    """What ``parallel.auto`` could not plan (the config is then kept as given)."""


def resolve(
    path: str | Path | None,
    overrides: Iterable[str] = (),
    *,
    world_size: int,
    local_world_size: int,
) -> Resolved:
    """The config a run of ``world_size`` ranks (``local_world_size`` per node) uses."""
    cfg = load(path, list(overrides))
    # Imported once the config reads: the planner and the layout checks bring torch
    # (~2 s), so a config error above is answered in a fraction of a second.
    from fsdpkit.planner.search.auto import accum_sync_choice, auto_plan
    from fsdpkit.sharding.experts.parallel import check_layout as check_expert_layout
    from fsdpkit.sharding.pipeline.split import check_pipeline_layout
    from fsdpkit.sharding.tensor.rules import check_layout

    changes: dict[str, Any] | None = None
    note = None
    if cfg.parallel.auto or cfg.parallel.accum_sync == "auto":
        sizes = {"world_size": world_size, "local_world_size": local_world_size}
        if cfg.parallel.auto:
            auto = auto_plan(cfg, **sizes)
            changes, note = auto.changes, auto.note
            cfg = with_changes(cfg, changes, source="parallel.auto")
        sync = accum_sync_choice(cfg, **sizes)  # [Note: accum_sync auto], auto's budget
        cfg = with_changes(
            cfg, {"parallel.accum_sync": sync, "parallel.auto": False}, source="parallel.auto"
        )
    validate_for_world(cfg, world_size=world_size, local_world_size=local_world_size)
    _check_builtin_model(cfg)
    check_layout(cfg)
    check_pipeline_layout(cfg)
    check_expert_layout(cfg)
    return Resolved(config=cfg, auto_changes=changes, auto_note=note)


def _check_builtin_model(cfg: RunConfig) -> None:
    """A built-in model's preset name and shape overrides, checked by the rule the
    worker builds it with (``llama_shape``), so a typo stops the launcher in one
    paragraph before any worker starts. The vocabulary is the tokenizer's, known only
    in the worker: any size passes here."""
    from fsdpkit.models.factory import llama_shape

    m = cfg.model
    if m.hf or m.factory:
        return
    llama_shape(m, vocab_size=m.vocab_size or 1, seq_len=cfg.data.seq_len)
