"""Async-save staging: fsdpkit's reused host buffers against DCP's ``DefaultStager``.

    python bench/checkpoint_staging.py [--reps 10] [--layers 6] [--dim 768] [--dir /tmp]
    python bench/checkpoint_staging.py --render-docs   # only re-render docs/checkpoints.md

Issue 52 item 5: use the library's stager unless ours wins beyond an A/A control. The
model and AdamW state are bench/checkpoint_io.py's (a ~62M-param Llama by default, ~374
MB per rank), sharded over 2 CPU gloo ranks. Every row is one ``Checkpointer`` with
``async_save`` on, the same save protocol (own gloo group, crc32s, commit) and only the
stager swapped in:

- fsdpkit's ``Stager`` (checkpoint/staging.py), and a second instance of it: the A/A
  control, which measures what "no difference" looks like on this machine;
- DCP's ``DefaultStager`` kept for the run (it caches a host copy per source storage and
  copies into it on later saves), with and without ``use_shared_memory``;
- a new ``DefaultStager`` per save, closed after staging: what ``dcp.async_save`` does
  when no ``async_stager`` is given (caching off).

On CPU the other ``StagingOptions`` do not apply: ``use_pinned_memory`` needs an
accelerator (the stager warns and ignores it), ``use_non_blocking_copy`` raises without
one, and ``use_async_staging`` copies on a thread while ``save`` returns, which is a
different contract (the loop must wait for the copy before its next optimizer step, and
here the copy would take the core the forward runs on); none of them is measured.

Each repetition saves once with every row, waiting for the save to commit before the
next; the order rotates per repetition, so drift on the shared machine hits all rows
alike. Blocking is ``last_blocking_s`` (what the training loop waits for), staging the
copy inside it (``state_dict()`` included); both the slower rank's. Ratios are paired:
a row's time over the fsdpkit row's in the same repetition; the table shows their
median and interquartile range. Verdict rule: of the two DCP
rows that keep their buffers, the one with the lower median blocking ratio is the one
fsdpkit would adopt; ours is kept only if that row's IQR lies wholly above the
control's (slower beyond the noise). Host memory is counted
from the stagers' own buffers: bytes newly allocated per save (after the first) and
bytes held between saves. Writes ``bench/results/checkpoint_staging.json`` and renders
its block in docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import results_io
import torch.distributed as dist
from checkpoint_io import _build, add_common_args
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from fsdpkit.checkpoint import Checkpointer
from fsdpkit.checkpoint.staging import Stager
from fsdpkit.checkpoint.stepdir import step_dir_name
from fsdpkit.config import CheckpointConfig
from fsdpkit.testing import run_ranks

NAME = "checkpoint_staging"
DOCS = results_io.ROOT / "docs" / "checkpoints.md"


class _DcpStager:
    """DCP's ``DefaultStager`` behind the interface ``Checkpointer`` calls (``stage``,
    ``nbytes``), counting the host bytes it allocates."""

    def __init__(self, *, shared_memory: bool, cached: bool) -> None:
        self._options = StagingOptions(
            use_pinned_memory=False,  # needs an accelerator
            use_shared_memory=shared_memory,
            use_async_staging=False,  # see the module docstring
            use_non_blocking_copy=False,  # raises without an accelerator
        )
        self._cached = cached
        self._stager = DefaultStager(self._options)
        self.allocated = 0
        """Bytes of host storage allocated by all saves so far."""

    def _storages(self) -> list[Any]:
        return list(self._stager._state_dict_stager._cached_storage_mapping.values())

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self._storages())

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if not self._cached:  # as dcp.async_save does: a stager per save, closed after
            self._stager = DefaultStager(self._options)
        before = {id(s) for s in self._storages()}  # ids only: cheap inside the timing
        staged = self._stager.stage(state_dict)
        assert isinstance(staged, dict)
        self.allocated += sum(s.nbytes() for s in self._storages() if id(s) not in before)
        if not self._cached:
            self._stager.close()
        return staged

    def close(self) -> None:
        self._stager.close()


class _CountingStager(Stager):
    """fsdpkit's ``Stager``, counting the bytes it allocates like ``_DcpStager``."""

    def __init__(self) -> None:
        super().__init__()
        self.allocated = 0

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        before = self.allocations
        staged = super().stage(state_dict)
        if self.allocations != before:
            self.allocated += self.nbytes
        return staged


ROWS = {
    "fsdpkit": ("fsdpkit Stager (reused buffers)", _CountingStager),
    "control": ("fsdpkit Stager, second instance (A/A control)", _CountingStager),
    "dcp": (
        "DCP DefaultStager, kept (cached)",
        lambda: _DcpStager(shared_memory=False, cached=True),
    ),
    "dcp_shm": (
        "DCP DefaultStager, kept (cached), shared memory",
        lambda: _DcpStager(shared_memory=True, cached=True),
    ),
    "dcp_fresh": (
        "DCP DefaultStager, new per save (no cache; dcp.async_save's default)",
        lambda: _DcpStager(shared_memory=False, cached=False),
    ),
}
"""key: (label, stager factory); "fsdpkit" is the reference of every ratio."""


def _saver(base: Path, key: str) -> Checkpointer:
    saver = Checkpointer(
        run_dir=base / key, cfg=CheckpointConfig(keep=1, async_save=True), run_meta={}
    )
    assert isinstance(saver._stager, Stager), "Checkpointer no longer keeps _stager"
    saver._stager = ROWS[key][1]()  # the one thing that differs between rows
    return saver


def _save(saver: Checkpointer, step: int, state: dict[str, Any]) -> dict[str, float]:
    dist.barrier()
    held = saver._stager.nbytes
    allocated = saver._stager.allocated
    saver.save(step, state)
    blocking = saver.last_blocking_s
    saver.wait()  # commit before the next row: its write must not overlap their staging
    return {
        "blocking": blocking,
        "staging": saver.last_save_timings["staging"],
        "allocated": float(saver._stager.allocated - allocated),
        "held": float(held),
    }


def williams(n: int) -> list[list[int]]:
    """Orders of ``n`` rows in which each row comes first, last and right after every
    other row equally often (a Williams design; 2n orders for odd n): a row that slows
    the next one down (its write still draining, its memory still hot) hits every row
    alike, which rotating one order would not (the same row would always follow)."""
    first = [0] + [(k + 1) // 2 if k % 2 else n - k // 2 for k in range(1, n)]
    orders = [[(i + r) % n for i in first] for r in range(n)]
    return orders + [o[::-1] for o in orders] if n % 2 else orders


def _bench(rank: int, world: int, shape: tuple[int, int, int], reps: int, where: str) -> dict:
    state, model = _build(*shape)
    base = Path(where)
    savers = {key: _saver(base, key) for key in ROWS}
    first = {key: _save(saver, 0, state) for key, saver in savers.items()}
    keys = list(ROWS)
    orders = williams(len(keys))
    runs = []
    for rep in range(reps):
        order = [keys[i] for i in orders[rep % len(orders)]]
        runs.append({key: _save(savers[key], rep + 1, state) for key in order})
    last = savers["fsdpkit"].root / step_dir_name(reps)
    for saver in savers.values():
        saver.close()
        saver._stager.close()
    return {
        "first": first,
        "runs": runs,
        "params": sum(p.numel() for p in model.parameters()),
        "bytes": float(sum(p.stat().st_size for p in last.iterdir())),
    }


def _slowest(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per repetition and row, the slower rank's times and the larger rank's bytes."""

    def worst(rows: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
        return {k: {f: max(r[k][f] for r in rows) for f in rows[0][k]} for k in rows[0]}

    return {
        "first": worst([r["first"] for r in ranks]),
        "runs": [worst(list(reps)) for reps in zip(*(r["runs"] for r in ranks))],
        "params": ranks[0]["params"],
        "bytes": ranks[0]["bytes"],
    }


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def summary(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per row: median seconds, paired ratio quartiles against the fsdpkit row, bytes."""
    runs = results["slowest"]["runs"]
    out = {}
    for key in ROWS:
        row: dict[str, Any] = {}
        for field in ("blocking", "staging"):
            row[field] = statistics.median(r[key][field] for r in runs)
            row[f"{field}_ratio"] = _quartiles([r[key][field] / r["fsdpkit"][field] for r in runs])
        row["first"] = results["slowest"]["first"][key]["blocking"]
        row["allocated"] = statistics.median(r[key]["allocated"] for r in runs)
        row["held"] = statistics.median(r[key]["held"] for r in runs)
        out[key] = row
    return out


def verdict(rows: dict[str, dict[str, Any]]) -> str:
    """Which stager the rule picks ([module docstring]): the DCP row fsdpkit would adopt
    is the one that keeps its buffers with the lower median blocking ratio; fsdpkit's
    Stager stays only if that row is slower beyond the control's spread (its lower
    quartile above the control's upper quartile)."""
    best = min(("dcp", "dcp_shm"), key=lambda k: rows[k]["blocking_ratio"][1])
    if rows[best]["blocking_ratio"][0] > rows["control"]["blocking_ratio"][2]:
        return f"fsdpkit's Stager wins beyond the A/A control against {ROWS[best][0]}: keep it"
    return f"{ROWS[best][0]} is as good within the A/A control: use it"


def _table(results: dict[str, Any]) -> str:
    s = results["slowest"]
    rows = summary(results)
    mb = 1e6
    lines = [
        f"Llama {s['params'] / 1e6:.1f}M params + AdamW, checkpoint {s['bytes'] / 1e9:.3f} GB, "
        "2 CPU gloo ranks, one Checkpointer per row (async save, same protocol); seconds are "
        "the slower rank's medians; ratio: paired with the fsdpkit row in the same "
        "repetition, median [interquartile range].",
        "",
        "| stager | blocking s | ratio | staging s | ratio | first save s "
        "| MB allocated per save | MB held between saves |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key, (label, _) in ROWS.items():
        r = rows[key]
        b, st = r["blocking_ratio"], r["staging_ratio"]
        lines.append(
            f"| {label} | {r['blocking']:.3f} | {b[1]:.2f} [{b[0]:.2f}, {b[2]:.2f}] "
            f"| {r['staging']:.3f} | {st[1]:.2f} [{st[0]:.2f}, {st[2]:.2f}] | {r['first']:.3f} "
            f"| {r['allocated'] / mb:,.1f} | {r['held'] / mb:,.1f} |"
        )
    lines += ["", f"Verdict (rule in `bench/{NAME}.py`): {verdict(rows)}."]
    return "\n".join(lines)


def render(results: dict[str, Any]) -> str:
    """docs/checkpoints.md's block (tests/unit/test_bench_docs.py checks it)."""
    head = results_io.provenance(results, NAME) + f" {results['reps']} alternated repetitions"
    head += f"; `uptime` before: {results['uptime']}."
    return head + "\n\n" + _table(results) + "\n"


def render_docs() -> None:
    results_io.render_into(DOCS, NAME, render(results_io.read(NAME)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    if args.render_docs:
        render_docs()
        return
    if args.reps < 4:
        sys.exit("--reps must be at least 4 (quartiles of the paired ratios)")
    shape = (args.layers, args.dim, args.ffn)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    where = tempfile.mkdtemp(prefix="fsdpkit-staging-bench-", dir=args.dir)
    t0 = time.perf_counter()
    try:
        ranks = run_ranks(_bench, world_size=2, args=(shape, args.reps, where), timeout_s=1800)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    results = {"shape": list(shape), "reps": args.reps, "uptime": uptime}
    results |= {"wall_s": round(time.perf_counter() - t0, 1), "slowest": _slowest(ranks)}
    print(_table(results))
    results_io.write(NAME, **results, ranks=ranks)
    render_docs()


if __name__ == "__main__":
    main()
