"""Resume: which checkpoints to try (rank 0), how to report failures, and the load.

[Note: resume decision]
Rank 0 lists the candidates (auto: complete checkpoints newest first; a path: just that
one) and broadcasts them. For each candidate every rank checksums its share of the files
(``verify(share=...)``), the problems are gathered and broadcast, so all ranks see the
same verdict and either load the same checkpoint or raise the same CheckpointError:
a corrupt checkpoint never leaves some ranks waiting in a collective.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fsdpkit.checkpoint.errors import CheckpointError, dcp_errors_as
from fsdpkit.checkpoint.layout import (
    complete_entries,
    list_entries,
    quiet_single_process,
    read_meta,
)
from fsdpkit.checkpoint.state import RankLocal

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Choice:
    path: Path
    step: int
    world_size: int
    """World size the checkpoint was saved at (for rank-local entries)."""


def _run_dir_hint(path: Path) -> str:
    if not list_entries(path):
        return ""
    inside = complete_entries(path)
    example = f", e.g. {inside[-1].path}" if inside else ""
    return f" {path} looks like a run directory; pass one of its checkpoints{example}."


def candidates(mode: str, root: Path) -> list[Path]:
    """Checkpoints to try in order ([Note: resume decision]); rank 0 only."""
    if mode == "auto":
        return [e.path for e in reversed(complete_entries(root))]
    path = Path(mode)
    if not path.exists():
        raise CheckpointError(
            f"checkpoint.resume = {mode!r}: no such directory. Use auto, never, or a "
            "checkpoint directory (`fsdpkit ckpt list RUN_DIR` shows them)."
        )
    try:
        read_meta(path)
    except CheckpointError as exc:
        raise CheckpointError(
            f"checkpoint.resume = {mode!r} cannot be used: {exc}{_run_dir_hint(path)}"
        ) from None
    return [path]


def fallback_warning(path: Path, problems: list[str]) -> str:
    return (
        f"{path.name} failed verification ({'; '.join(problems)}); falling back to the "
        "previous complete checkpoint"
    )


def unusable(mode: str, root: Path, failed: list[tuple[Path, list[str]]]) -> CheckpointError:
    """The error when every candidate failed verification."""
    if mode != "auto":
        problems = failed[0][1]
        return CheckpointError(
            f"checkpoint.resume = {mode!r} cannot be used: {'; '.join(problems)}. Pick "
            "another complete checkpoint (`fsdpkit ckpt list RUN_DIR`) or use "
            "checkpoint.resume=auto."
        )
    detail = " | ".join(f"{p.name}: {'; '.join(probs)}" for p, probs in failed)
    return CheckpointError(
        f"no checkpoint under {root} verifies ({detail}). Restore the damaged files, resume "
        "from another copy with checkpoint.resume=PATH, or move them away and start fresh "
        "with checkpoint.resume=never."
    )


def choice_for(path: Path) -> Choice:
    meta = read_meta(path)
    return Choice(path, int(meta["step"]), int(meta.get("world_size", 1)))


def loadable(state: dict[str, Any], *, saved_world: int, world_size: int) -> dict[str, Any]:
    """``state`` minus rank-local entries the checkpoint cannot supply
    ([Note: rank-local state]): skipped on every rank alike when the world grew."""
    if world_size <= saved_world:
        return dict(state)
    skipped = sorted(k for k, v in state.items() if isinstance(v, RankLocal))
    if skipped:
        log.warning(
            "checkpoint: saved at world size %d, loading at %d: rank-local state %s not "
            "restored (kept as initialized)",
            saved_world,
            world_size,
            skipped,
        )
    return {k: v for k, v in state.items() if k not in skipped}


def load(
    choice: Choice,
    state: dict[str, Any],
    *,
    group: dist.ProcessGroup | None,
    world_size: int,
) -> None:
    """DCP-load ``choice`` into ``state`` in place (reshards to this world size)."""
    target = loadable(state, saved_world=choice.world_size, world_size=world_size)
    with (
        dcp_errors_as(
            lambda cause: (
                f"loading checkpoint {choice.path} failed: {cause}. The checkpoint "
                "does not fit this run's state (different model shape, optimizer or state keys?); "
                f"resume with the configuration it was saved with (`fsdpkit ckpt inspect "
                f"{choice.path}`), or set checkpoint.resume=never."
            )
        ),
        quiet_single_process(),
    ):
        dcp.load(target, checkpoint_id=str(choice.path), process_group=group)
