"""One-pass checkpoint I/O in one process: the writer's in-line checksums, the reader's
direct loads and verification, torch.save record parsing, reused staging buffers,
fsdpkit's own state as tensors, and clear write failures."""

from __future__ import annotations

import errno
import io
import json
import random
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from fsdpkit.checkpoint import Checkpointer, CheckpointError, RNGState, list_entries
from fsdpkit.checkpoint import writer as writer_mod
from fsdpkit.checkpoint.checksum import crc32_file
from fsdpkit.checkpoint.reader import ChecksumMismatch, VerifyingReader
from fsdpkit.checkpoint.records import dense_span, tensor_record
from fsdpkit.checkpoint.staging import Stager
from fsdpkit.checkpoint.stepdir import META_FILE, quiet_single_process, read_meta
from fsdpkit.checkpoint.untrusted import SafeLoadPlanner, read_metadata
from fsdpkit.checkpoint.writer import ChecksumWriter
from fsdpkit.config import CheckpointConfig
from fsdpkit.data import PackedLoader
from fsdpkit.train.state import TrainerState
from support import LoadProbe

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "dense": torch.randn(64, 32, generator=g),
        "bf16": torch.randn(40, generator=g).bfloat16(),
        "scalar": torch.tensor(seed, dtype=torch.int64),
        "strided": torch.randn(16, 8, generator=g).t(),  # saved with its strides
        "empty": torch.zeros(0, 3),
        "obj": {"lr": [0.1, 0.2], "name": f"run-{seed}", "raw": b"\x00\x01"},
    }


def _save(path: Path, state: dict[str, Any]) -> ChecksumWriter:
    writer = ChecksumWriter(path)
    with quiet_single_process():
        dcp.save(state, storage_writer=writer, no_dist=True)
    return writer


def _load(path: Path, records: dict[str, Any], state: dict[str, Any], *, owned: bool) -> Any:
    md = read_metadata(path, {"files": records})
    names = [n for n in records if n != ".metadata"] if owned else []
    reader = VerifyingReader(path, metadata=md, records=records, owned=names)
    with quiet_single_process():
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return reader.stats


def test_writer_checksums_what_it_writes_and_reader_loads_it_back(tmp_path: Path) -> None:
    before = torch.serialization.get_crc32_options()
    saved = _state(1)
    writer = _save(tmp_path / "c", saved)
    assert torch.serialization.get_crc32_options() == before  # restored after the write
    files = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert sorted(writer.records) == files and ".metadata" in files
    for name, record in writer.records.items():
        path = tmp_path / "c" / name
        assert record == {"bytes": path.stat().st_size, "crc32": crc32_file(path)}, name
    target = _state(2)
    stats = _load(tmp_path / "c", writer.records, target, owned=True)
    for key in ("dense", "bf16", "scalar", "strided", "empty"):
        assert torch.equal(target[key], saved[key]) and target[key].dtype == saved[key].dtype
    assert target["obj"] == saved["obj"]
    assert stats.direct_bytes >= saved["dense"].numel() * 4  # straight into the target
    plain = _state(3)  # the files stay plain DCP: DCP's own reader loads them too
    with quiet_single_process():
        dcp.load(plain, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert torch.equal(plain["strided"], saved["strided"])


def _trainer(*, step: int, scale: float) -> TrainerState:
    loader = PackedLoader(
        torch.arange(4096), seq_len=8, micro_batch_size=2, dp_rank=0, dp_world=1, seed=0
    )
    for _ in range(step):
        loader.next_step()
    trainer = TrainerState(loader=loader, scaler=torch.amp.GradScaler("cpu", init_scale=scale))
    trainer.step = step
    return trainer


def _applied(state: dict[str, Any]) -> tuple[Any, ...]:
    trainer = state["trainer"]
    return trainer.step, trainer.loader.state_dict(), trainer.scaler.state_dict()


def test_reader_names_a_corrupt_file_before_any_stateful_is_loaded(tmp_path: Path) -> None:
    """The owner finds the mismatch while reading, so ``dcp.load`` fails before its last
    step, the Statefuls' ``load_state_dict``: the trainer's step, data position and grad
    scaler keep their values. Tensors loaded straight into their targets are written by
    then ([Note: verified single-pass load]); resume falls back or stops."""
    saved = {**_state(1), "trainer": _trainer(step=11, scale=1024.0), "probe": LoadProbe()}
    writer = _save(tmp_path / "c", saved)
    data = tmp_path / "c" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-40] ^= 0xFF  # in the zip trailer of the last item: never loaded, only hashed
    data.write_bytes(bytes(raw))
    target = {**_state(2), "trainer": _trainer(step=0, scale=2.0), "probe": LoadProbe()}
    before = _applied(target)
    with pytest.raises(BaseException) as info:
        _load(tmp_path / "c", writer.records, target, owned=True)
    failures = getattr(info.value, "failures", {})
    assert any(isinstance(e, ChecksumMismatch) for e, _ in failures.values()), info.value
    assert "__0_0.distcp is corrupt" in str(info.value)
    assert _applied(target) == before and target["probe"].loaded == 0
    _load(tmp_path / "c", writer.records, target, owned=False)  # no owner: no check
    assert _applied(target) == _applied(saved) != before and target["probe"].loaded == 1


def _checkpoint(run: Path, *, step: int = 1) -> tuple[Checkpointer, dict[str, Any]]:
    state = {"t": _state(step), "probe": LoadProbe()}
    saver = Checkpointer(run_dir=run, cfg=CheckpointConfig(), run_meta={})
    saver.save(step, state)
    return saver, state


def test_resume_fails_before_any_state_is_applied(tmp_path: Path) -> None:
    _checkpoint(tmp_path, step=1)
    ckpt = tmp_path / "checkpoints" / "step-00000001"
    raw = bytearray((ckpt / "__0_0.distcp").read_bytes())
    raw[len(raw) // 2] ^= 0x01
    (ckpt / "__0_0.distcp").write_bytes(bytes(raw))
    state = {"t": _state(5), "probe": LoadProbe()}
    cfg = CheckpointConfig(resume=str(ckpt))
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is corrupt"):
        Checkpointer(run_dir=tmp_path, cfg=cfg, run_meta={}).resume(state)
    assert state["probe"].loaded == 0


class _Evil:
    """Pickles as a call to os.system: what a crafted non-tensor value would hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        import os

        return (os.system, (f"touch {self.marker}",))


def test_pickled_values_that_would_run_code_are_refused(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    saver = Checkpointer(run_dir=tmp_path, cfg=CheckpointConfig(), run_meta={})
    saver.save(1, {"t": {"x": torch.ones(2), "evil": _Evil(marker)}})  # checksums match
    state = {"t": {"x": torch.zeros(2), "evil": None}}
    with pytest.raises(CheckpointError, match="does not load safely"):
        Checkpointer(run_dir=tmp_path, cfg=CheckpointConfig(), run_meta={}).resume(state)
    assert not marker.exists()


def test_tensor_record_reads_zip64_and_refuses_anything_else() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    buf = io.BytesIO()
    torch.save(t, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src:
        members = {i.filename: src.read(i) for i in src.infolist() if "pkl" in i.filename}
    payload = t.numpy().tobytes()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:  # sizes in zip64 fields
        for name, data in [*members.items(), ("archive/data/0", payload)]:
            with zf.open(name, "w", force_zip64=True) as f:
                f.write(data)
    raw = bytearray(out.getvalue())
    rec = tensor_record(lambda o, n: bytes(raw[o : o + n]), len(raw))
    assert rec is not None and rec.dense and torch.equal(rec.view(memoryview(raw)), t)
    other = io.BytesIO()
    torch.save({"a": 1}, other)
    data = other.getvalue()
    assert tensor_record(lambda o, n: data[o : o + n], len(data)) is None
    assert dense_span((4, 3), (1, 0), (2, 3)) == (3, 6)
    assert dense_span((4, 3), (0, 1), (4, 2)) is None


def test_stager_reuses_its_buffers() -> None:
    stager = Stager()
    src = {"w": torch.randn(8, 4), "step": 3, "nested": {"b": torch.ones(5)}}
    first = stager.stage(src)
    src["w"].add_(1.0)  # training moves on; the staged copy must not
    assert not torch.equal(first["w"], src["w"])
    second = stager.stage(src)
    assert second["w"].data_ptr() == first["w"].data_ptr() and stager.allocations == 1
    assert torch.equal(second["w"], src["w"]) and second["step"] == 3
    assert stager.nbytes == (32 + 5) * 4
    src["w"] = torch.randn(9, 4)  # structure changed: new buffers
    assert stager.stage(src)["w"].shape == (9, 4) and stager.allocations == 2


def test_rng_and_trainer_state_are_tensors_and_round_trip() -> None:
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    random.gauss(0, 1)  # a cached Gaussian in Python's state
    rng = RNGState().state_dict()
    assert all(isinstance(v, torch.Tensor) for v in rng.values())
    expect = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    RNGState().load_state_dict(rng)
    assert (random.random(), np.random.rand()) == expect[:2] and torch.equal(
        torch.rand(1), expect[2]
    )
    loader = PackedLoader(
        torch.arange(4096), seq_len=8, micro_batch_size=2, dp_rank=0, dp_world=1, seed=0
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    trainer = TrainerState(loader=loader, scaler=scaler)
    trainer.step = 11
    sd = trainer.state_dict()
    leaves = [sd["step"], *sd["data"].values(), *sd["scaler"].values()]
    assert all(isinstance(v, torch.Tensor) for v in leaves)
    other = TrainerState(loader=loader, scaler=torch.amp.GradScaler("cpu"))
    other.load_state_dict(sd)
    assert other.step == 11 and other.scaler is not None
    assert other.scaler.state_dict() == scaler.state_dict()


@pytest.mark.parametrize(
    ("code", "advice"),
    [
        (errno.ENOSPC, "disk is full"),
        (errno.EROFS, "read-only"),
        (errno.EACCES, "permissions"),
        (errno.EIO, "I/O error"),
    ],
)
@pytest.mark.parametrize("where", ["write", "commit"])
def test_write_failures_name_the_cause_and_the_last_good_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, advice: str, where: str
) -> None:
    saver, state = _checkpoint(tmp_path, step=1)

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise OSError(code, f"injected {errno.errorcode[code]}")

    if where == "write":
        monkeypatch.setattr(writer_mod._HashingStream, "write", fail)
    else:
        monkeypatch.setattr("fsdpkit.checkpoint.commit.write_json_durably", fail)
    with pytest.raises(CheckpointError) as info:
        saver.save(2, state)
    msg = str(info.value)
    assert "step 2" in msg and advice in msg and "\n" not in msg
    assert f"injected {errno.errorcode[code]}" in msg
    assert str(tmp_path / "checkpoints" / "step-00000001") in msg  # the last good one
    assert [e.path.name for e in list_entries(tmp_path)] == ["step-00000001"]  # nothing torn


def test_marker_and_metadata_checks(tmp_path: Path) -> None:
    _checkpoint(tmp_path, step=1)
    ckpt = tmp_path / "checkpoints" / "step-00000001"
    meta = read_meta(ckpt)
    assert meta["files"][".metadata"]["crc32"] == crc32_file(ckpt / ".metadata")
    read_metadata(ckpt, meta)
    (ckpt / ".metadata").write_bytes((ckpt / ".metadata").read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="does not match the size and crc32"):
        read_metadata(ckpt, meta)
    meta["files"]["x"] = {"bytes": "many"}
    (ckpt / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="not a valid fsdpkit checkpoint marker"):
        read_meta(ckpt)


def test_foreign_dcp_metadata_is_read_without_running_code(tmp_path: Path) -> None:
    """Checkpoints fsdpkit did not write (FSDP1's, read by `model.init_from`) have no
    checksum to check: their .metadata still goes through the restricted unpickler."""
    import pickle

    from fsdpkit.checkpoint.untrusted import RestrictedReader, UnsafeCheckpointError

    good = tmp_path / "good"
    with quiet_single_process():
        dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(good), no_dist=True)
    assert "w" in RestrictedReader(str(good)).read_metadata().state_dict_metadata
    marker = tmp_path / "PWNED"
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system|os\.system"):
        RestrictedReader(str(evil)).read_metadata()
    assert not marker.exists()
