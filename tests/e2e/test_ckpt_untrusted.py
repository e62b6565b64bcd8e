"""Untrusted and damaged checkpoints through the CLI: nothing runs code, every command
fails in one paragraph, and ``ckpt list`` shows every checkpoint whatever its state.

A crafted ``.metadata`` pickle calls ``os.system`` to create a marker file. It is
tried once with fsdpkit.json left alone (checksum mismatch) and once with
fsdpkit.json rewritten to match it; ``inspect``, ``verify``, ``export`` and resume
(``checkpoint.resume=auto`` and an explicit path) run on both. The two ``fsdpkit
train`` runs on the matching file (the case that used to run the code) go through a
subprocess and run while everything else does; the ``ckpt`` commands run through
``fsdpkit.cli.main`` in this process (same parsing, printing and exit codes, without
~3 s of torch import each), and the mismatching resumes through ``Checkpointer``.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from clirun import FAST, start

from fsdpkit.checkpoint import Checkpointer, CheckpointError, ModelOptimizerState
from fsdpkit.checkpoint.checksum import crc32_file
from fsdpkit.cli import main
from fsdpkit.config import CheckpointConfig
from fsdpkit.models.llama import Llama, LlamaConfig

pytestmark = pytest.mark.e2e

SMALL = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)


def _checkpoint(run: Path, step: int) -> Path:
    model = Llama(SMALL)
    opt = torch.optim.AdamW(model.parameters())
    saver = Checkpointer(run_dir=run, cfg=CheckpointConfig(keep=10), run_meta={})
    saver.save(step, {"app": ModelOptimizerState(model, opt)})
    return run / "checkpoints" / f"step-{step:08d}"


def _plant(ckpt: Path, payload: bytes, *, match: bool) -> None:
    (ckpt / ".metadata").write_bytes(payload)
    if match:  # the attacker rewrites the marker too
        meta = json.loads((ckpt / "fsdpkit.json").read_text())
        meta["files"][".metadata"] = {
            "bytes": len(payload),
            "crc32": crc32_file(ckpt / ".metadata"),
        }
        (ckpt / "fsdpkit.json").write_text(json.dumps(meta))


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def _resume(run: Path, resume: str) -> tuple[int, str, str]:
    model = Llama(SMALL)
    state = {"app": ModelOptimizerState(model, torch.optim.AdamW(model.parameters()))}
    cfg = CheckpointConfig(resume=resume)
    try:
        Checkpointer(run_dir=run, cfg=cfg, run_meta={}).resume(state)
    except CheckpointError as exc:
        return 2, "", f"{exc}\n"
    return 0, "", ""


def _damaged(tmp: Path, good: Path) -> dict[str, tuple[int, str, str]]:
    listed = tmp / "listed"
    _checkpoint(listed, 1)
    (_checkpoint(listed, 2) / "fsdpkit.json").write_text('{"format": "fsdpkit-che')
    shutil.copytree(good, listed / "checkpoints" / "step-00000003.tmp")
    truncated = _checkpoint(tmp / "truncated", 4)
    (truncated / ".metadata").write_bytes((truncated / ".metadata").read_bytes()[:50])
    garbage = _checkpoint(tmp / "garbage", 5)
    _plant(garbage, b"\x80\x04not a pickle at all", match=True)
    return {
        "list": _cli("ckpt", "list", str(listed)),
        "truncated": _cli("ckpt", "inspect", str(truncated)),
        "garbage": _cli("ckpt", "inspect", str(garbage)),
    }


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    tmp = tmp_path_factory.mktemp("untrusted")
    marker = tmp / "PWNED"
    evil = f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()
    good = _checkpoint(tmp / "good", 1)
    procs: dict[str, subprocess.Popen[str]] = {}
    results: dict[str, tuple[int, str, str]] = {}
    for case in ("match", "mismatch"):
        run = tmp / case
        ckpt = run / "checkpoints" / good.name
        shutil.copytree(good, ckpt)
        _plant(ckpt, evil, match=case == "match")
        for kind, resume in (("auto", "auto"), ("path", str(ckpt))):
            if case == "match":  # at once: each in its own run dir (one run per run dir)
                run_dir = run if kind == "auto" else tmp / f"{case}-{kind}-run"
                args = [*FAST, f"checkpoint.resume={resume}", f"logging.run_dir={run_dir}"]
                procs[f"{case}-train-{kind}"] = start("train", "--nproc", "1", *args, cwd=tmp)
            else:
                results[f"{case}-train-{kind}"] = _resume(run, resume)
        results[f"{case}-inspect"] = _cli("ckpt", "inspect", str(ckpt))
        results[f"{case}-verify"] = _cli("ckpt", "verify", str(ckpt))
        results[f"{case}-export"] = _cli("ckpt", "export", str(ckpt), str(tmp / f"{case}-hf"))
    results |= _damaged(tmp, good)
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=180)
        results[name] = (p.returncode, stdout, stderr)
    return {"marker": marker, **results}


CRAFTED = [
    f"{case}-{cmd}"
    for case in ("mismatch", "match")
    for cmd in ("inspect", "verify", "export", "train-auto", "train-path")
]


@pytest.mark.parametrize("name", CRAFTED)
def test_crafted_metadata_runs_no_code(session: dict, name: str) -> None:
    code, out, err = session[name]
    assert not session["marker"].exists(), "the crafted pickle ran"
    assert code != 0, (out, err)
    assert "Traceback" not in err, err[-3000:]
    assert ".metadata" in out + err
    if name.startswith("match"):  # the checksum matched: the unpickler refused it
        assert "os.system" in out + err and "refuses to unpickle" in out + err
    else:  # verify checks sizes first: the crafted file is smaller
        assert "does not match the size and crc32" in out + err or "truncated" in out + err
    if "train" not in name and "verify" not in name:
        assert code == 2 and len(err.strip().splitlines()) == 1, err


def test_list_shows_every_state_and_never_fails(session: dict) -> None:
    code, out, err = session["list"]
    assert code == 0, err
    lines = out.splitlines()
    assert lines[1].split()[0] == "1" and lines[1].endswith("complete")
    assert lines[2].split()[0] == "2" and lines[2].endswith("unreadable marker")
    assert lines[3].split()[0] == "3" and lines[3].endswith("partial")
    assert "step-00000002" in err and "fsdpkit.json" in err


@pytest.mark.parametrize("name", ["truncated", "garbage"])
def test_inspect_of_damaged_metadata_is_one_paragraph(session: dict, name: str) -> None:
    code, out, err = session[name]
    assert code == 2 and out == ""
    assert "Traceback" not in err and "UnpicklingError" not in err.split(":")[0]
    assert len(err.strip().splitlines()) == 1 and ".metadata" in err
