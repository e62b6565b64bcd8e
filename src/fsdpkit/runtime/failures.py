"""Why a run failed, said once: the rank that failed first and how.

[Note: root cause]
When one rank fails, its peers fail too, a moment later, with connection errors
("Connection reset by peer", "connection closed"): those are consequences. Each
worker that raises writes a record (``rank-R-attempt-A.json``, see
``fsdpkit.runtime.distenv.write_error``); the launcher picks, of the last restart attempt:

1. the earliest record that is not a lost-peer message (a real error);
2. else a rank that died by a signal without writing anything (SIGKILL, SIGSEGV...):
   the agent's exit status names it; for SIGKILL the kernel's OOM-kill counters
   (``/proc/vmstat`` oom_kill, the cgroup's ``memory.events`` / ``memory.oom_control``)
   taken before and after tell whether the OOM killer did it;
3. else the earliest record.

[Note: lost node]
With several nodes, a rank whose only error is a lost peer ("Connection closed by
peer [ADDR]:PORT") and no local rank that died means another node went away: its
launcher was killed, its machine died, or the network to it failed. The surviving
node says that, naming the peer's address (gloo's message carries it) and the ranks
that were not on this node, instead of rank 0's traceback; the lost node's own log
says why it stopped.
"""

from __future__ import annotations

import json
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdpkit.checkpoint.stepdir import complete_entries

# Messages of ranks that failed only because another rank went away first.
_SECONDARY = (
    "connection closed",
    "connection reset",
    "broken pipe",
    "timed out",
    "sigterm",
    "terminated",
    "socket",
    "gloo",
    "nccl",
)


def _read_records(directory: Path) -> list[dict[str, Any]]:
    records = []
    for path in directory.glob("rank-*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    if not records:
        return []
    last = max(int(r.get("attempt", 0)) for r in records)
    return sorted((r for r in records if int(r.get("attempt", 0)) == last), key=lambda r: r["time"])


def is_secondary(message: str) -> bool:
    """Whether an error message reads like a consequence of a peer going away."""
    lowered = message.lower()
    return any(k in lowered for k in _SECONDARY)


def root_cause(directory: Path) -> dict[str, object] | None:
    """The record to show ([Note: root cause] 1 and 3), or None without records."""
    records = _read_records(directory)
    if not records:
        return None
    primary = [r for r in records if not is_secondary(str(r["message"]))]
    return (primary or records)[0]


def _cgroup_counter_files() -> list[Path]:
    files: list[Path] = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return files
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            files.append(Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.events")
        elif "memory" in controllers.split(","):
            files.append(Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.oom_control")
    return files


def _counter(path: Path) -> int | None:
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


@dataclass(frozen=True)
class OomCounters:
    """The kernel's OOM-kill counters that this process can read, by file."""

    counts: dict[str, int] = field(default_factory=dict)

    @classmethod
    def read(cls) -> OomCounters:
        counts = {}
        for path in [Path("/proc/vmstat"), *_cgroup_counter_files()]:
            value = _counter(path)
            if value is not None:
                counts[str(path)] = value
        return cls(counts)

    def rose_since(self, before: OomCounters) -> list[str]:
        """``file: a -> b`` for each counter that went up."""
        return [
            f"{path}: {before.counts[path]} -> {n}"
            for path, n in self.counts.items()
            if path in before.counts and n > before.counts[path]
        ]


@dataclass(frozen=True)
class SignalDeath:
    """A worker that died by a signal without reporting an error."""

    rank: int
    pid: int
    signum: int


def signal_deaths(failures: dict[int, Any]) -> list[SignalDeath]:
    """Ranks of a ChildFailedError's failures that were ended by a signal, earliest
    first (a negative exit code is the signal number)."""
    dead = sorted((f.timestamp, rank, f) for rank, f in failures.items() if int(f.exitcode) < 0)
    return [SignalDeath(rank, int(f.pid), -int(f.exitcode)) for _, rank, f in dead]


def describe_signal_death(death: SignalDeath, *, oom: list[str]) -> str:
    """One paragraph: which rank, which signal, what likely sent it."""
    name = signal.Signals(death.signum).name
    head = f"rank {death.rank} (pid {death.pid}) was killed by {name} (signal {death.signum})"
    if oom:
        why = (
            "; the kernel's OOM killer ran at that moment (" + "; ".join(oom) + "): the "
            "machine ran out of memory. Use fewer ranks per machine, a smaller micro-batch, "
            "activation checkpointing or offload (`fsdpkit plan` shows what fits)"
        )
    elif death.signum == signal.SIGKILL:
        why = (
            ". SIGKILL comes from outside the process: a job scheduler, `kill -9`, or the "
            "OOM killer (its counters did not move, so probably not memory)"
        )
    elif death.signum in (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL):
        why = (
            ". That is a crash inside native code (PyTorch, a CUDA driver or an extension); "
            "rerun to see whether it repeats, and check the versions of torch and drivers"
        )
    else:
        why = ". Something outside fsdpkit sent that signal to the worker"
    return (
        f"{head}{why}. The other ranks stopped because their peer went away; their "
        "connection errors are consequences, not the cause."
    )


def newest_checkpoint_note(run_dir: Path | None) -> str:
    """``The newest complete checkpoint is step N (PATH).`` for messages about a stop."""
    if run_dir is None:
        return ""

    try:
        entries = complete_entries(Path(run_dir))
    except OSError:
        entries = []
    if not entries:
        return f"There is no complete checkpoint in {Path(run_dir) / 'checkpoints'}."
    newest = entries[-1]
    return (
        f"The newest complete checkpoint is step {newest.step} ({newest.path}); the same "
        "command resumes from it."
    )


_PEER = re.compile(r"by peer \[?([0-9A-Za-z:.%-]+?)\]?:(\d+)")


def lost_peer(message: str) -> str | None:
    """The peer address in a lost-peer message's first line (gloo names it)."""
    first = message.strip().splitlines()[0] if message.strip() else ""
    peer = _PEER.search(first)
    return peer.group(1) if peer else None


def describe_lost_node(
    message: str, *, local_ranks: list[int], world_size: int, name: str | None = None
) -> str:
    """One paragraph for a node whose ranks failed only because a peer on another
    node went away ([Note: lost node]); ``name``: that node's host name, if known."""
    first = message.strip().splitlines()[0] if message.strip() else "?"
    peer = _PEER.search(first)
    others = sorted(set(range(world_size)) - set(local_ranks))
    where = f"the node at {peer.group(1)}" if peer else "another node of the job"
    if peer and name:
        where = f"node {name} at {peer.group(1)}"
    ranks = f" (ranks {', '.join(map(str, others))})" if others else ""
    said = f"connection closed by peer {peer.group(1)}:{peer.group(2)}" if peer else first[:200]
    return (
        f"lost {where}{ranks}: this node's ranks stopped when their collective failed "
        f"({said}). That node's launcher was killed, its machine went down, or the "
        "network to it failed; its own log says which. Bring it back and rerun the same "
        "command on every node."
    )
