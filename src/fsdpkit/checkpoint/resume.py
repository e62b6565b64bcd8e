"""Resume: which checkpoints to try (rank 0), how to report failures, and the load.

[Note: resume decision]
Rank 0 lists the candidates (auto: complete checkpoints newest first; a path: just that
one) and broadcasts them. For each candidate, rank 0 ``precheck``s it (every recorded
file present with its recorded size; ``.metadata`` matching its crc32 and parsed by the
restricted unpickler) and broadcasts the verdict and the parsed metadata. Then all
ranks load it with ``VerifyingReader``, which checksums every file while loading
([Note: verified single-pass load]); a mismatch fails the load on every rank alike
before any loaded state is used. Either way all ranks see the same verdict and load
the same checkpoint, fall back to the same previous one (auto), or raise the same
CheckpointError: a corrupt checkpoint never leaves some ranks waiting in a collective.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from fsdpkit.checkpoint.errors import CheckpointError, describe_failure
from fsdpkit.checkpoint.frozen import FrozenBaseMismatch
from fsdpkit.checkpoint.gcpause import gc_paused
from fsdpkit.checkpoint.itemreads import LoadStats
from fsdpkit.checkpoint.reader import ChecksumMismatch, VerifyingReader
from fsdpkit.checkpoint.statefuls import RankLocal, state_info
from fsdpkit.checkpoint.stepdir import (
    DCP_METADATA,
    complete_entries,
    file_owner,
    list_entries,
    quiet_single_process,
    read_meta,
    verify,
)
from fsdpkit.checkpoint.untrusted import SafeLoadPlanner, UnsafeCheckpointError, read_metadata

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Choice:
    """A candidate after ``precheck``: loadable unless ``problems``."""

    path: Path
    step: int
    world_size: int
    """World size the checkpoint was saved at (for rank-local entries)."""
    records: dict[str, Any] = field(default_factory=dict)
    """fsdpkit.json's ``files``: name -> size and crc32."""
    metadata: Metadata | None = None
    problems: list[str] = field(default_factory=list)
    trainable_only: bool = False
    """The checkpoint holds only the trainable parameters (``checkpoint.adapters_only``)."""


def precheck(path: Path) -> Choice:
    """Rank 0's cheap look before loading ([Note: resume decision]): no data file is
    read; ``.metadata`` is read, checked and parsed safely."""
    report = verify(path, checksums=False)
    if report.problems:
        return Choice(path, report.step or 0, 0, problems=report.problems)
    meta = read_meta(path)
    try:
        metadata = read_metadata(path, meta)
    except CheckpointError as exc:
        return Choice(path, int(meta["step"]), 0, problems=[str(exc)])
    only = bool(meta.get("state", {}).get("trainable_only", False))
    return Choice(
        path, int(meta["step"]), int(meta.get("world_size", 1)), meta["files"], metadata,
        trainable_only=only,
    )  # fmt: skip


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


def owned_files(records: dict[str, Any], *, rank: int, world_size: int) -> list[str]:
    """The data files this rank checksums while loading ([Note: verified single-pass
    load]); ``.metadata`` was checked by ``precheck``."""
    return [
        name
        for name in records
        if name != DCP_METADATA and file_owner(name, world_size=world_size) == rank
    ]


def _mismatches(exc: BaseException) -> tuple[list[str], UnsafeCheckpointError | None]:
    """Verification problems and an unsafe-object refusal inside DCP's exception."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return [], None
    problems: list[str] = []
    unsafe = None
    for _, (err, _tb) in sorted(failures.items(), key=lambda kv: kv[0]):
        if isinstance(err, ChecksumMismatch):
            problems += [p for p in err.problems if p not in problems]
        elif isinstance(err, UnsafeCheckpointError) and unsafe is None:
            unsafe = err
    return problems, unsafe


def load(
    choice: Choice,
    state: dict[str, Any],
    *,
    group: dist.ProcessGroup | None,
    rank: int,
    world_size: int,
) -> tuple[list[str], LoadStats]:
    """DCP-load ``choice`` into ``state`` in place (reshards to this world size),
    verifying this rank's share of the files while reading. Returns the files that did
    not verify (nothing was applied to ``state`` then, except tensors written in place)
    and this rank's read statistics; CheckpointError if it does not fit ``state``."""
    assert choice.metadata is not None
    if choice.trainable_only and not state_info(state)["trainable_only"]:
        raise CheckpointError(
            f"checkpoint {choice.path} holds only the trainable parameters "
            "(checkpoint.adapters_only = true), but this run loads the whole model. Resume "
            "with checkpoint.adapters_only = true: the frozen base then comes from the model "
            "settings, as when it was saved."
        )
    target = loadable(state, saved_world=choice.world_size, world_size=world_size)
    reader = VerifyingReader(
        choice.path,
        metadata=choice.metadata,
        records=choice.records,
        owned=owned_files(choice.records, rank=rank, world_size=world_size),
    )
    t0 = time.perf_counter()
    reader.read_ahead()
    try:
        with quiet_single_process(), gc_paused():
            dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner(), process_group=group)
        reader.stats.load_s = time.perf_counter() - t0
    except (KeyboardInterrupt, SystemExit, FrozenBaseMismatch):
        raise  # the mismatch is its own paragraph ([Note: adapters need their base])
    except BaseException as exc:
        problems, unsafe = _mismatches(exc)
        if unsafe is not None:  # refused like a file that fails its checksum
            problems.append(str(unsafe))
        if problems:
            return problems, reader.stats
        raise CheckpointError(
            f"loading checkpoint {choice.path} failed: {describe_failure(exc)}. The checkpoint "
            "does not fit this run's state (different model shape, optimizer or state keys?); "
            f"resume with the configuration it was saved with (`fsdpkit ckpt inspect "
            f"{choice.path}`), or set checkpoint.resume=never."
        ) from None
    return [], reader.stats
