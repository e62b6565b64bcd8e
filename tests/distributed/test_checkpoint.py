"""Checkpoints never lose work: exact resume, crash during save, corruption, write
failures, async saves, retention (2 gloo ranks, fp32).

Every scenario runs inside ONE 2-rank spawn (start-up dominates); the parent asserts on
what each scenario returned.
"""

from __future__ import annotations

import errno
import logging
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_fs
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fsdpkit import RunConfig, build_mesh, shard
from fsdpkit.checkpoint import (
    Checkpointer,
    CheckpointError,
    ModelOptimizerState,
    RankLocal,
    RNGState,
    list_entries,
    verify,
)
from fsdpkit.checkpoint import checkpointer as checkpointer_mod
from fsdpkit.checkpoint.stepdir import quiet_single_process
from fsdpkit.config import CheckpointConfig
from fsdpkit.testing import run_ranks
from support import SEQ, TINY, build, full_state, lm_loss

pytestmark = pytest.mark.distributed

WORLD = 2
RUN_META = {"world_size": WORLD, "mesh": [1, WORLD], "strategy": "full", "model": TINY.to_dict()}


class Trainer:
    """The loop's own state: step, data position, grad-scaler-like dict, raw bytes."""

    def __init__(self) -> None:
        self.step = 0
        self.data = {"epoch": 0, "offset": 0}
        self.scaler = {"scale": 1024.0, "growth_tracker": 0}

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "data": dict(self.data), "scaler": dict(self.scaler), "b": b"x"}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        assert sd["b"] == b"x"
        self.step, self.data, self.scaler = sd["step"], dict(sd["data"]), dict(sd["scaler"])


def _lr(step: int) -> float:
    return min(1.0, (step + 1) / 4) * 0.9 ** (step / 4)


def make(*, seed: int) -> tuple[Any, ...]:
    model = build(TINY, seed=seed)
    shard(model, RunConfig(), mesh=build_mesh(device_type="cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr)
    trainer = Trainer()
    state = {
        "app": ModelOptimizerState(model, opt),
        "scheduler": sched,
        "trainer": trainer,
        "rng": RankLocal(RNGState()),
    }
    return model, opt, sched, trainer, state


def steps(parts: tuple[Any, ...], n: int, ckpt: Checkpointer | None = None) -> list[float]:
    """n steps whose data comes from this rank's RNG streams (so resume must restore them)."""
    model, opt, sched, trainer, state = parts
    losses = []
    for _ in range(n):
        tokens = torch.randint(0, TINY.vocab_size, (2, SEQ + 1))
        trainer.data["offset"] += random.randint(1, 3)
        loss = lm_loss(model, tokens)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / WORLD)
        trainer.step += 1
        if ckpt is not None:
            ckpt.maybe_save(trainer.step, state)
    return losses


def seed_streams(rank: int) -> None:
    torch.manual_seed(100 + rank)
    random.seed(rank)


def ckpt(run: Path, **kw: Any) -> Checkpointer:
    return Checkpointer(run_dir=run, cfg=CheckpointConfig(**kw), run_meta=RUN_META)


def scenario_resume(rank: int, tmp: Path) -> dict[str, Any]:
    seed_streams(rank)
    straight = make(seed=0)
    ref_losses = steps(straight, 20)
    seed_streams(rank)
    first = make(seed=0)
    saver = ckpt(tmp / "resume", every=5, keep=2)
    losses = steps(first, 10, saver)
    torch.manual_seed(999)  # the resumed run must not depend on the current streams
    second = make(seed=1)
    step = ckpt(tmp / "resume", every=5, keep=2).resume(second[4])
    trainer = second[3]
    out = {"step": step, "trainer": (trainer.step, trainer.data, trainer.scaler)}
    losses += steps(second, 10)
    out |= {"ref": ref_losses, "got": losses, "ref_params": full_state(straight[0])}
    out |= {"params": full_state(second[0]), "lr": second[2].get_last_lr()}
    out["ref_lr"] = straight[2].get_last_lr()
    out["parts"] = second
    return out


def scenario_async(rank: int, tmp: Path, parts: tuple[Any, ...]) -> dict[str, Any]:
    sync = ckpt(tmp / "sync")
    sync.save(20, parts[4])
    asy = ckpt(tmp / "async", async_save=True)
    asy.save(20, parts[4])
    steps(parts, 2)  # training mutates params and optimizer state while it writes
    asy.wait()
    return {
        "sync_s": sync.last_blocking_s,
        "async_s": asy.last_blocking_s,
        "total_s": asy.last_total_s,
    }


def scenario_crash(rank: int, tmp: Path, parts: tuple[Any, ...]) -> dict[str, Any]:
    run = tmp / "crash"
    saver = ckpt(run, keep=3)
    saver.save(20, parts[4])
    real = checkpointer_mod.Checkpointer._finalize
    checkpointer_mod.Checkpointer._finalize = lambda self, job: None  # type: ignore[method-assign]
    try:
        saver.save(22, parts[4])  # "dies" after DCP wrote everything, before the marker
    finally:
        checkpointer_mod.Checkpointer._finalize = real  # type: ignore[method-assign]
    dist.barrier()
    names_after_crash = sorted(p.name for p in (run / "checkpoints").iterdir())
    fresh = make(seed=3)
    restarted = ckpt(run, keep=3)
    step = restarted.resume(fresh[4])
    restarted.save(24, fresh[4])
    dist.barrier()
    names_after_save = sorted(p.name for p in (run / "checkpoints").iterdir())
    return {"step": step, "after_crash": names_after_crash, "after_save": names_after_save}


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _damage(path: Path, *, truncate: bool) -> None:
    data = bytearray(path.read_bytes())
    if truncate:
        path.write_bytes(bytes(data[: len(data) // 2]))
        return
    mid = len(data) // 2
    data[mid : mid + 16] = bytes(b ^ 0xFF for b in data[mid : mid + 16])
    path.write_bytes(bytes(data))


def _try_resume(run: Path, resume: str, parts: tuple[Any, ...]) -> int | str | None:
    try:
        return ckpt(run, resume=resume).resume(parts[4])
    except CheckpointError as exc:
        return f"CheckpointError: {exc}"


def scenario_corrupt(rank: int, tmp: Path, parts: tuple[Any, ...]) -> dict[str, Any]:
    run = tmp / "corrupt"
    saver = ckpt(run, keep=3)
    saver.save(20, parts[4])
    saver.save(22, parts[4])
    root = run / "checkpoints"
    if rank == 0:
        _damage(root / "step-00000022" / "__1_0.distcp", truncate=False)
    dist.barrier()
    capture = _Capture()
    logging.getLogger("fsdpkit.checkpoint").addHandler(capture)
    out: dict[str, Any] = {"auto": _try_resume(run, "auto", parts)}
    out["warnings"] = capture.messages
    out["explicit"] = _try_resume(run, str(root / "step-00000022"), parts)
    if rank == 0:
        _damage(root / "step-00000020" / "__0_0.distcp", truncate=True)
    dist.barrier()
    out["truncated"] = _try_resume(run, str(root / "step-00000020"), parts)
    out["none_verify"] = _try_resume(run, "auto", parts)
    out["partial"] = _try_resume(run, str(run), parts)
    return out


def scenario_enospc(rank: int, tmp: Path, parts: tuple[Any, ...]) -> dict[str, Any]:
    run = tmp / "enospc"
    saver = ckpt(run, keep=3)
    saver.save(20, parts[4])
    real = dcp_fs._write_item

    def full_disk(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    out: dict[str, Any] = {}
    for mode in ("sync", "async"):
        if rank == 1:  # only one rank fails: the others must not hang
            dcp_fs._write_item = full_disk  # type: ignore[assignment]
        try:
            saver.save(22, parts[4], blocking=mode == "sync")
            saver.wait()
            out[mode] = "no error"
        except CheckpointError as exc:
            out[mode] = str(exc)
        finally:
            dcp_fs._write_item = real
        dist.barrier()
        out[f"{mode}_dirs"] = sorted(p.name for p in (run / "checkpoints").iterdir())
    out["resumed"] = _try_resume(run, "auto", make(seed=5))
    return out


def scenario_retention(rank: int, tmp: Path, parts: tuple[Any, ...]) -> list[str]:
    run = tmp / "retention"
    saver = ckpt(run, every=2, keep=2, keep_every=4, async_save=True)
    for step in range(1, 11):
        saver.maybe_save(step, parts[4])
    saver.maybe_save(11, parts[4], final=True)
    saver.maybe_save(11, parts[4], final=True)  # same step twice: no second save
    saver.close()
    dist.barrier()
    return [e.path.name for e in list_entries(run)]


def _all(rank: int, world: int, tmp: str) -> dict[str, Any]:
    base = Path(tmp)
    out = {"resume": scenario_resume(rank, base)}
    parts = out["resume"].pop("parts")
    out["async"] = scenario_async(rank, base, parts)
    out["crash"] = scenario_crash(rank, base, parts)
    out["corrupt"] = scenario_corrupt(rank, base, parts)
    out["enospc"] = scenario_enospc(rank, base, parts)
    out["retention"] = scenario_retention(rank, base, parts)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("ckpt")
    return tmp, run_ranks(_all, world_size=WORLD, args=(str(tmp),), timeout_s=300)


def test_resume_is_bitwise_exact(results: tuple[Path, list[dict[str, Any]]]) -> None:
    for r in results[1]:
        got = r["resume"]
        assert got["step"] == 10
        assert got["trainer"][0] == 10 and got["trainer"][2] == {
            "scale": 1024.0,
            "growth_tracker": 0,
        }
        assert got["got"] == got["ref"], "losses differ after resume"
        assert got["lr"] == got["ref_lr"]
        for key, ref in got["ref_params"].items():
            assert torch.equal(got["params"][key], ref), key
    # rank-local RNG streams: the two ranks drew different data, and each kept its own
    assert results[1][0]["resume"]["trainer"][1] != results[1][1]["resume"]["trainer"][1]


def _tensors(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    md = dcp.FileSystemReader(str(ckpt_dir)).read_metadata().state_dict_metadata
    sd = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in md.items()
        if isinstance(v, TensorStorageMetadata)
    }
    with quiet_single_process():
        dcp.load(sd, checkpoint_id=str(ckpt_dir), no_dist=True)
    return sd


def test_async_save_equals_sync_save(results: tuple[Path, list[dict[str, Any]]]) -> None:
    tmp, ranks = results
    a = _tensors(tmp / "sync" / "checkpoints" / "step-00000020")
    b = _tensors(tmp / "async" / "checkpoints" / "step-00000020")
    assert a.keys() == b.keys() and any(".optim.state." in k for k in a)
    assert "app.model.lm_head.weight" not in a  # tied head stored once
    for key in a:
        assert torch.equal(a[key], b[key]), key
    for r in ranks:
        assert r["async"]["sync_s"] > 0 and r["async"]["async_s"] > 0
    assert verify(tmp / "async" / "checkpoints" / "step-00000020").ok


def test_crash_during_save_is_ignored(results: tuple[Path, list[dict[str, Any]]]) -> None:
    for r in results[1]:
        crash = r["crash"]
        assert crash["after_crash"] == ["step-00000020", "step-00000022.tmp"]
        assert crash["step"] == 20
        assert crash["after_save"] == ["step-00000020", "step-00000024"]  # leftover removed


def test_corrupt_shard_falls_back_and_explicit_load_fails(
    results: tuple[Path, list[dict[str, Any]]],
) -> None:
    tmp, ranks = results
    for r in ranks:
        c = r["corrupt"]
        assert c["auto"] == 20
        assert "__1_0.distcp is corrupt" in c["explicit"], c["explicit"]
        assert "step-00000022" in c["explicit"]
        assert "__0_0.distcp is truncated" in c["truncated"], c["truncated"]
        assert "no checkpoint under" in c["none_verify"]
        assert "looks like a run directory" in c["partial"]
    assert any("step-00000022 failed verification" in w for w in ranks[0]["corrupt"]["warnings"])
    report = verify(tmp / "corrupt" / "checkpoints" / "step-00000022")
    assert not report.ok and any("__1_0.distcp" in p for p in report.problems)


def test_write_failure_is_clear_and_keeps_old_checkpoints(
    results: tuple[Path, list[dict[str, Any]]],
) -> None:
    for r in results[1]:
        e = r["enospc"]
        for mode in ("sync", "async"):
            assert "No space left on device" in e[mode], e[mode]
            assert "step 22" in e[mode] and "untouched" in e[mode]
            assert e[f"{mode}_dirs"] == ["step-00000020"]
        assert e["resumed"] == 20


def test_retention_keeps_newest_and_multiples(results: tuple[Path, list[dict[str, Any]]]) -> None:
    # every=2 -> saves 2,4,6,8,10 + final 11; keep=2 -> 10, 11; keep_every=4 -> 4, 8
    for r in results[1]:
        assert r["retention"] == [
            "step-00000004",
            "step-00000008",
            "step-00000010",
            "step-00000011",
        ]
