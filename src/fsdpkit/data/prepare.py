"""``prepare``: sources -> a memory-mappable dataset, once, in parallel, atomically.

[Note: prepare protocol]
1. Resolve the sources, tell text from SFT (fsdpkit.data.plan), build the tokenizer.
2. If OUT holds a dataset made from the same sources (paths, sizes and mtimes; when an
   mtime changed, the same sha256), tokenizer fingerprint and options: done (a no-op).
   If it differs: a DataError naming what changed, unless ``rebuild``.
3. Cut the sources into units; tokenize them in ``workers`` processes (spawned: a fresh
   interpreter, no inherited threads), each writing its shard files into a hidden
   sibling ``.OUT.tmp-PID-RANDOM``; the sources are hashed meanwhile.
4. Copy the tokenizer files, write ``manifest.json`` last, fsync.
5. Rename the temporary directory to OUT (an old OUT is renamed aside first and
   removed after). A prepare killed at any point leaves OUT as it was (or absent), never
   half written: a directory without its manifest is not a dataset, and a hidden
   ``.tmp`` directory is never read (the next prepare removes those of dead processes).
"""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import secrets
import shutil
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from fsdpkit.config import DataConfig
from fsdpkit.data.errors import DataError
from fsdpkit.data.manifest import MANIFEST, TOKENIZER_DIR, Manifest, Shard, is_dataset, token_dtype
from fsdpkit.data.plan import Plan, plan_units, resolve_config
from fsdpkit.data.prepare_progress import Progress
from fsdpkit.data.recipe import differences, recipe, sha256_file, source_stats
from fsdpkit.data.sources import Resolved, resolve
from fsdpkit.data.work import Job, Result, init_worker, run

ALIVE = ".alive"
"""A lock file a running prepare holds in its temporary directory."""
SPAWN_S = 3.0
"""Seconds a spawned worker takes to start (it imports fsdpkit, hence torch)."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)


@dataclass(frozen=True)
class Prepared:
    path: Path
    manifest: Manifest
    reused: bool
    """Nothing was done: OUT already held this dataset."""
    seconds: float
    plan_notes: tuple[str, ...] = ()


def prepare(
    cfg: DataConfig,
    out: Path,
    *,
    paths: list[str] | None = None,
    rebuild: bool = False,
    progress: bool = True,
) -> Prepared:
    """Prepare ``paths`` (default: data.path, or the built-in corpus) into ``out``
    ([Note: prepare protocol]); ``cfg`` gives the tokenizer and options."""
    start = time.perf_counter()
    resolved = _resolve_all(cfg, paths)
    kind, tokenizer, options = recipe(cfg, resolved)
    sources = source_stats(resolved)
    if is_dataset(out):
        old = Manifest.read(out)
        changes = differences(old, kind=kind, tokenizer=tokenizer, options=options, sources=sources)
        if not changes and not old.problems(out):
            return Prepared(out, old, reused=True, seconds=time.perf_counter() - start)
        if not rebuild:
            raise DataError(
                f"{out} holds a dataset prepared from other inputs: {'; '.join(changes[:4])}. "
                "fsdpkit never mixes tokens of different sources or tokenizers: prepare into "
                "another directory, or pass --rebuild to replace it."
            )
    plan = plan_units(resolved, max_bytes=cfg.max_bytes)
    manifest = _build(
        cfg,
        out,
        plan=plan,
        kind=kind,
        tokenizer=tokenizer,
        options=options,
        sources=sources,
        progress=progress,
    )
    return Prepared(
        out,
        manifest,
        reused=False,
        seconds=time.perf_counter() - start,
        plan_notes=tuple(plan.notes),
    )


def _resolve_all(cfg: DataConfig, paths: list[str] | None) -> Resolved:
    if not paths:
        return resolve_config(cfg)
    out = Resolved([])
    for p in paths:
        found = resolve(p)
        out.sources += found.sources
        out.left_out += found.left_out
    return out


def _build(
    cfg: DataConfig,
    out: Path,
    *,
    plan: Plan,
    kind: str,
    tokenizer: dict[str, Any],
    options: dict[str, Any],
    sources: list[dict[str, Any]],
    progress: bool,
) -> Manifest:
    """Steps 3-5 of [Note: prepare protocol]."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    alive = _hold(tmp)
    try:
        dtype = token_dtype(int(tokenizer["vocab_size"]))
        hashes: dict[str, str] = {}
        failed: list[str] = []
        hasher = threading.Thread(target=_hash_all, args=(sources, hashes, failed), daemon=True)
        hasher.start()
        results = _run_units(cfg, plan, tmp=tmp, kind=kind, dtype=dtype, progress=progress)
        hasher.join()
        if failed:
            raise DataError(
                f"could not read every source of {out} to record its sha256: {failed[0]}. "
                "The manifest needs each source's hash to tell when the data changed; make "
                "the file readable, or leave it out of data.path."
            )
        for s in sources:
            s["sha256"] = hashes[s["path"]]
        manifest = _manifest(
            plan,
            results,
            kind=kind,
            dtype=dtype,
            tokenizer=tokenizer,
            options=options,
            sources=sources,
        )
        if kind == "text" and not manifest.counts["tokens"]:
            raise DataError(f"{_name(cfg)} holds no text: nothing to train on.")
        _copy_tokenizer(cfg, tmp)
        (tmp / ALIVE).unlink()
        _write_manifest(tmp, manifest)
        _commit(tmp, out)
        return manifest
    finally:
        alive.close()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _name(cfg: DataConfig) -> str:
    return f"data.path ({cfg.path})" if cfg.path else "the built-in corpus"


def _hash_all(sources: list[dict[str, Any]], into: dict[str, str], failed: list[str]) -> None:
    """Every source's sha256 into ``into``; the first unreadable one, with its OS error,
    into ``failed`` (the caller's message names it)."""
    for s in sources:  # hashlib releases the GIL on large buffers: runs beside the workers
        try:
            into[s["path"]] = sha256_file(Path(s["path"]))
        except OSError as err:
            failed.append(f"{s['path']} ({err.strerror or err})")
            return


def _run_units(
    cfg: DataConfig, plan: Plan, *, tmp: Path, kind: str, dtype: str, progress: bool
) -> list[Result]:
    """Every unit's shard, in order: the first one here, which times the tokenizer; the
    rest in spawned workers when that is faster despite their start-up (``SPAWN_S``:
    a BPE tokenizer at a few MB/s gains from a few MB on, the byte-level one at
    ~100 MB/s only from about a GB), else here too."""
    jobs = [
        Job(plan.sources, unit, str(tmp), f"shard-{i:05d}", kind, dtype, cfg)
        for i, unit in enumerate(plan.units)
    ]
    bar = Progress(total_bytes=plan.planned_bytes, label="preparing") if progress else None

    def done(result: Result) -> Result:
        if bar:
            bar.update(result.nbytes, result.shard.tokens)
        return result

    start = time.perf_counter()
    results = [done(run(jobs[0]))] if jobs else []
    rate = results[0].nbytes / max(time.perf_counter() - start, 1e-6) if jobs else 1.0
    rest = sum(p.nbytes for job in jobs[1:] for p in job.pieces)
    workers = min(cfg.workers or os.cpu_count() or 1, len(jobs) - 1)
    if workers > 1 and SPAWN_S + rest / rate / workers < rest / rate:
        results += _in_workers(jobs[1:], workers=workers, done=done)
    results += [done(run(job)) for job in jobs[len(results) :]]
    if bar:
        bar.close()
    return results


def _in_workers(jobs: list[Job], *, workers: int, done: Any) -> list[Result]:
    """The jobs' results from spawned workers, in order, as many as they gave: workers
    that cannot start (a ``__main__`` that cannot be re-imported, such as a script on
    stdin) leave the rest to this process, with a notice."""
    context = multiprocessing.get_context("spawn")
    out: list[Result] = []
    with ProcessPoolExecutor(workers, context, initializer=init_worker) as pool:
        try:
            for result in pool.map(run, jobs):
                out.append(done(result))
        except BrokenProcessPool as exc:
            print(f"data: prepare workers stopped ({exc}); continuing in this process")
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return out


def _manifest(plan: Plan, results: list[Result], **fields: Any) -> Manifest:
    schemas: dict[str, int] = {}
    for r in results:
        for k, n in r.schemas.items():
            schemas[k] = schemas.get(k, 0) + n
    shards: list[Shard] = [r.shard for r in results]
    docs = sum(s.docs for s in shards)
    if fields["kind"] == "text":
        schemas = {"text": docs}
    counts = {
        "documents": docs,
        "tokens": sum(s.tokens for s in shards),
        "answer_tokens": sum(s.answer_tokens for s in shards),
        "empty_replies": sum(r.empty_replies for r in results),
        "source_files": len(plan.sources),
        "source_bytes": plan.planned_bytes,
        "left_out_bytes": plan.left_out_bytes,
        "left_out_files": plan.left_out_files,
    }
    try:
        version = metadata.version("fsdpkit")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return Manifest(
        shards=shards,
        schemas=schemas,
        counts=counts,
        fsdpkit_version=version,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        **fields,
    )


def _copy_tokenizer(cfg: DataConfig, tmp: Path) -> None:
    if not cfg.tokenizer:
        return
    folder = Path(cfg.tokenizer).expanduser()
    folder = folder.parent if folder.is_file() else folder
    (tmp / TOKENIZER_DIR).mkdir()
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, tmp / TOKENIZER_DIR / name)


def _write_manifest(tmp: Path, manifest: Manifest) -> None:
    path = tmp / MANIFEST
    with path.open("w", encoding="utf-8") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(tmp: Path, out: Path) -> None:
    """Step 5: the finished directory takes OUT's name (the old one moved aside first)."""
    aside = None
    if out.exists():
        aside = out.parent / f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(out, aside)
    os.rename(tmp, out)
    _fsync_dir(out.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def remove_stale(out: Path) -> None:
    """Leftovers of prepares that died: a ``.tmp`` directory whose ``ALIVE`` lock no
    process holds any more (the kernel drops it with its holder), and any set-aside old
    dataset (garbage once the new one has taken its name)."""
    for entry in out.parent.glob(f".{out.name}.old-*"):
        shutil.rmtree(entry, ignore_errors=True)
    for entry in out.parent.glob(f".{out.name}.tmp-*"):
        try:
            with (entry / ALIVE).open("a") as f:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live prepare
        except OSError:
            pass  # no lock file yet: a prepare that died right after mkdir
        shutil.rmtree(entry, ignore_errors=True)


def _hold(tmp: Path) -> Any:
    """Lock ``tmp/ALIVE`` for as long as this prepare runs (see ``remove_stale``)."""
    f = (tmp / ALIVE).open("w")
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    return f
