"""How a pipelined plan reads ([Note: pipeline plans] in fsdpkit.planner.pipeline.plan):
the schedule, the bubble and the traffic, and one line per pipeline rank. Formats
only; the figures come from ``Plan.pipeline``."""

from __future__ import annotations

import dataclasses
from typing import Any

from fsdpkit.planner.shapes.result import Plan


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def pipeline_lines(p: Plan) -> list[str]:
    """The report's pipeline section (empty without pp)."""
    pipe = p.pipeline
    if pipe is None:
        return []
    worst = pipe.worst
    lines = [
        f"pipeline: pp {pipe.pp} x {pipe.stages_per_rank} stage(s) per rank, {pipe.schedule} "
        f"over {pipe.micro_batches} micro-batches: bubble {pipe.bubble:.0%} of a step; "
        f"stage-to-stage p2p up to {_size(pipe.p2p_bytes)} sent per rank per step"
    ]
    stage_lines = pipe.split.describe().splitlines()  # one per pipeline rank, in order
    for r in pipe.ranks:
        peak = r.memory.peak
        where = f"{peak.phase}: {peak.where}" if peak.where else peak.phase
        lines.append(
            f"  {stage_lines[r.rank]}; peak {_size(peak.bytes)} ({where}); "
            f"p2p {_size(r.p2p_bytes)}; FSDP traffic {_size(r.comm.total)}"
        )
    lines.append(
        f"  the memory and traffic figures above are pp rank {worst.rank}'s, the highest peak"
    )
    return lines


def pipeline_dict(p: Plan) -> dict[str, Any] | None:
    """A JSON-ready dict of ``Plan.pipeline`` (None without pp)."""
    pipe = p.pipeline
    if pipe is None:
        return None
    return {
        "schedule": pipe.schedule,
        "pp": pipe.pp,
        "stages_per_rank": pipe.stages_per_rank,
        "micro_batches": pipe.micro_batches,
        "bubble": pipe.bubble,
        "split": {"blocks": pipe.split.blocks, "ranks": pipe.split.ranks},
        "ranks": [
            {
                "rank": r.rank,
                "stages": r.stages,
                "memory": dataclasses.asdict(r.memory),
                "p2p_bytes": r.p2p_bytes,
                "comm": dataclasses.asdict(r.comm) | {"total": r.comm.total},
            }
            for r in pipe.ranks
        ],
    }
