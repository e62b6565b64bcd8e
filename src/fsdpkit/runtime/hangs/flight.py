"""torch's Flight Recorder: every collective a rank issued, on gloo and NCCL alike.

[Note: flight recorder]
Since torch 2.5 each process group backend records every collective it is asked for
(op, sequence number per group, input/output sizes and dtypes, state, the Python stack
that issued it) in one in-process ring buffer of ``TORCH_FR_BUFFER_SIZE`` entries
(``TORCH_NCCL_TRACE_BUFFER_SIZE`` before 2.7); in torch 2.13 gloo records into it too
(``gloo:all_gather``...). That is the cheapest complete record of "the last
collective" there is: it sees FSDP2's all-gathers and reduce-scatters, DTensor's
functional collectives and DCP's, in C++, at ~1-3 us per collective
(bench/hang_overhead.py). ``fsdpkit train`` turns it on (2000 entries, a few steps of
a large model) unless you set the variable, and on NCCL also asks torch to dump it
when the watchdog sees a collective time out (``TORCH_NCCL_DUMP_ON_TIMEOUT``), to
``RUN_DIR/hang/flight-recorder/rank_<R>``, the layout torch's analyzer reads::

    python -m torch.distributed.flight_recorder.fr_trace RUN_DIR/hang/flight-recorder

On a hang the launcher asks each rank's triage thread for a dump
(``torch._C._distributed_c10d._dump_fr_trace``, a pickle of plain containers: read
here with an unpickler that refuses every global) and summarizes it per rank:
collectives issued per group, the newest one, its size, whether it completed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import pickle
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BUFFER_ENTRIES = 2000
FLIGHT_DIR = "flight-recorder"
DUMP_PREFIX = "rank_"

_DTYPE_BYTES = {
    "Float": 4,
    "Double": 8,
    "Half": 2,
    "BFloat16": 2,
    "Long": 8,
    "Int": 4,
    "Short": 2,
    "Char": 1,
    "Byte": 1,
    "Bool": 1,
    "ComplexFloat": 8,
    "ComplexDouble": 16,
    "Float8_e4m3fn": 1,
    "Float8_e5m2": 1,
}


def prepare(*, hang_dir: Path, device_type: str) -> dict[str, str]:
    """Variables that turn the recorder on ([Note: flight recorder]), to apply where
    the user has not set them (fsdpkit.runtime.distenv.set_env_defaults). On GPUs also the
    directory NCCL's dump-on-timeout writes to: torch opens ``PREFIX<rank>`` without
    creating directories (an empty ``RUN_DIR/hang/flight-recorder`` in every GPU run)."""
    prefix = str(hang_dir / FLIGHT_DIR / DUMP_PREFIX)
    env = {"TORCH_FR_BUFFER_SIZE": str(BUFFER_ENTRIES)}
    if device_type == "cuda":
        with contextlib.suppress(OSError):  # a bad run dir is claim_run_dir's to report
            (hang_dir / FLIGHT_DIR).mkdir(parents=True, exist_ok=True)
        env.update(
            TORCH_NCCL_TRACE_BUFFER_SIZE=str(BUFFER_ENTRIES),  # the name before torch 2.7
            TORCH_NCCL_DUMP_ON_TIMEOUT="1",
            TORCH_FR_DUMP_TEMP_FILE=prefix,
            TORCH_NCCL_DEBUG_INFO_TEMP_FILE=prefix,  # the name before torch 2.7
        )
    return env


class _PlainUnpickler(pickle.Unpickler):
    """Containers, strings and numbers only: the recorder's dump needs no more."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"unexpected global {module}.{name} in a flight record")


def dump(
    *, rank: int, hang_dir: Path | None, groups: dict[str, list[int]]
) -> dict[str, Any] | None:
    """This process's recorder contents (None when it is off or unavailable); also
    written for torch's analyzer when ``hang_dir`` is given, with ``pg_config`` filled
    from ``groups`` (group name -> global ranks) where the backend left it empty:
    gloo does, and the analyzer cannot match a collective to its group without it."""
    import torch.distributed as dist

    if not dist.is_available():
        return None
    from torch._C import _distributed_c10d

    dump_fn = getattr(_distributed_c10d, "_dump_fr_trace", None)  # not in torch's stubs
    if dump_fn is None:
        return None
    raw: bytes = dump_fn(True, True, False)  # collectives, their stacks, not only active ones
    data: dict[str, Any] = _PlainUnpickler(io.BytesIO(raw)).load()
    if not data.get("entries"):
        return None
    config = dict(data.get("pg_config") or {})
    for entry in data["entries"]:
        name, desc = [*(entry.get("process_group") or []), "", ""][:2]
        if name not in config and name in groups:
            config[name] = {"name": name, "desc": desc, "ranks": str(groups[name])}
    data["pg_config"] = config
    if hang_dir is not None:
        target = hang_dir / FLIGHT_DIR / f"{DUMP_PREFIX}{rank}"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(pickle.dumps(data))
    return data


def load(path: Path) -> dict[str, Any] | None:
    """A dump file (NCCL's on a timeout, or ours), read without running code; None if
    unreadable."""
    try:
        with path.open("rb") as f:
            data = _PlainUnpickler(f).load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("entries") else None


def groups_of(data: dict[str, Any]) -> dict[str, list[int]]:
    """Global ranks per group name from a dump's ``pg_config``."""
    groups = {}
    for name, config in (data.get("pg_config") or {}).items():
        with contextlib.suppress(TypeError, ValueError, AttributeError):
            groups[str(name)] = [int(r) for r in json.loads(str(config.get("ranks", "[]")))]
    return groups


def group_ranks() -> dict[str, list[int]]:
    """Global ranks of every process group this rank knows, by group name (the
    recorder's own ``pg_config`` is empty for gloo groups)."""
    try:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _world

        return {str(name): dist.get_process_group_ranks(pg) for pg, name in _world.pg_names.items()}
    except Exception:  # a private table: a report without group ranks is still a report
        return {}


@dataclass(frozen=True)
class Collective:
    """One recorded collective."""

    seq: int
    """Its number on its group (``collective_seq_id``), the same on every member."""
    op: str
    group: str
    group_desc: str
    bytes: int
    """Input bytes (all inputs of a coalesced op)."""
    shapes: str
    state: str
    """completed, started (not completed), not completed, or timed out (set from the
    rank's progress record: the recorder does not tell)."""
    age_s: float
    """Seconds between its issue and the dump."""
    frames: list[str]
    """The Python stack that issued it, innermost first (``file:line in fn``)."""

    def describe(self) -> str:
        return (
            f"#{self.seq} {self.op} on group {self.group} ({self.group_desc}): {self.shapes}, "
            f"{human_bytes(self.bytes)}, issued {self.age_s:.1f} s before the report, "
            f"{self.state}"
        )


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def _collective(entry: dict[str, Any], *, now_ns: int) -> Collective:
    sizes = entry.get("input_sizes") or []
    dtypes = entry.get("input_dtypes") or []
    total = 0
    for shape, dtype in zip(sizes, dtypes):
        count = 1
        for dim in shape:
            count *= int(dim)
        total += count * _DTYPE_BYTES.get(str(dtype), 4)
    shapes = " ".join(f"{list(s)} {d}" for s, d in zip(sizes, dtypes)) or "no tensors"
    group = [*(entry.get("process_group") or []), "?", "?"]
    name, desc = group[0], group[1]
    frames = [
        f"{f.get('filename')}:{f.get('line')} in {f.get('name')}" for f in entry.get("frames") or []
    ]
    return Collective(
        seq=int(entry.get("collective_seq_id") or entry.get("p2p_seq_id") or 0),
        op=str(entry.get("profiling_name", "?")),
        group=str(name),
        group_desc=str(desc),
        bytes=total,
        shapes=shapes,
        state=_state(entry),
        age_s=max(now_ns - int(entry.get("time_created_ns") or now_ns), 0) / 1e9,
        frames=frames,
    )


def _state(entry: dict[str, Any]) -> str:
    """completed, started (not completed) or not completed: gloo's entries stay
    ``scheduled`` and set ``retired`` when their work finished."""
    if entry.get("state") == "completed" or entry.get("retired"):
        return "completed"
    return "started, not completed" if entry.get("state") == "started" else "not completed"


@dataclass(frozen=True)
class FlightSummary:
    """One rank's recorder, reduced to what the report compares."""

    issued: dict[str, int]
    """Collectives issued per group name (the newest ``collective_seq_id``)."""
    groups: dict[str, list[int]]
    """Global ranks of each group."""
    recent: list[Collective]
    """The newest collectives, newest first."""

    @property
    def last(self) -> Collective | None:
        return self.recent[0] if self.recent else None

    def timed_out(self) -> FlightSummary:
        """The same, with the newest collective marked as the one that timed out (gloo
        retires a timed-out collective as if it had completed)."""
        if not self.recent:
            return self
        newest = dataclasses.replace(self.recent[0], state="timed out")
        return dataclasses.replace(self, recent=[newest, *self.recent[1:]])

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FlightSummary:
        recent = [Collective(**c) for c in data.get("recent", [])]
        return cls(issued=dict(data["issued"]), groups=dict(data["groups"]), recent=recent)


def summarize(
    data: dict[str, Any], *, groups: dict[str, list[int]], keep: int = 8
) -> FlightSummary:
    """Per-group counts and the newest ``keep`` collectives of one rank's dump."""
    now_ns = time.time_ns()
    entries = sorted(data.get("entries", []), key=lambda e: int(e.get("record_id", 0)))
    issued: dict[str, int] = {}
    for entry in entries:
        if entry.get("is_p2p"):
            continue
        name = str((entry.get("process_group") or ["?"])[0])
        issued[name] = max(issued.get(name, 0), int(entry.get("collective_seq_id") or 0))
    recent = [_collective(e, now_ns=now_ns) for e in reversed(entries[-keep:])]
    return FlightSummary(issued=issued, groups=groups, recent=recent)


def write_summary(summary: FlightSummary | None, path: Path, *, note: str = "") -> None:
    """For the launcher: the summary as JSON (or why there is none)."""
    payload = {"summary": summary.to_json() if summary else None, "note": note}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload))
    tmp.replace(path)


def read_summary(path: Path) -> tuple[FlightSummary | None, str]:
    """The launcher's side of ``write_summary``: (summary, note)."""
    try:
        payload = json.loads(path.read_text())
    except (OSError, ValueError):
        return None, "no answer"
    summary = payload.get("summary")
    return (FlightSummary.from_json(summary) if summary else None), str(payload.get("note", ""))
