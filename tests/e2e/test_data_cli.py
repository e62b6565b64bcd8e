"""``fsdpkit data prepare|inspect`` as a user runs them: prepare, a no-op rerun, inspect
(and --verify finding a flipped byte), a prepare killed mid-way that leaves nothing a
run would load, SFT files read as SFT, --help-config naming every data key, and
``fsdpkit train data.path=DIR`` on the prepared dataset."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from clirun import FAST, fsdpkit, start

pytestmark = pytest.mark.e2e
FIXTURES = Path(__file__).parents[1] / "fixtures" / "data"
TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(20000))


def test_prepare_rerun_inspect_verify(tmp_path: Path) -> None:
    (tmp_path / "corpus").mkdir()
    for i in range(3):
        (tmp_path / "corpus" / f"{i}.txt").write_text(TEXT[: 30000 * (i + 1)])
    out = tmp_path / "ds"
    first = fsdpkit("data", "prepare", "corpus", "-o", str(out), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "plain text: 3 file(s)" in first.stdout and f"data.path={out}" in first.stdout
    again = fsdpkit("data", "prepare", "corpus", "-o", str(out), cwd=tmp_path)
    assert "is up to date" in again.stdout
    info = fsdpkit("data", "inspect", str(out), "--json", cwd=tmp_path)
    summary = json.loads(info.stdout)
    assert info.returncode == 0 and summary["ok"] and summary["counts"]["documents"] == 3
    shard = out / "shard-00000.tokens"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    bad = fsdpkit("data", "inspect", str(out), "--verify", cwd=tmp_path)
    assert bad.returncode == 1 and "crc32" in bad.stderr


def test_killed_prepare_leaves_nothing_a_run_would_load(tmp_path: Path, launched: list) -> None:
    pytest.importorskip("tokenizers")
    from tiny_hf import write_tokenizer

    (tmp_path / "tok").mkdir()
    write_tokenizer(tmp_path / "tok", vocab_size=400)
    (tmp_path / "big.txt").write_text(TEXT * 4)  # ~4.6 MB of BPE: seconds of work
    out = tmp_path / "ds"
    args = ("data", "prepare", "big.txt", "-o", str(out), "--tokenizer", "tok", "--workers", "1")
    proc = start(*args, cwd=tmp_path)
    launched.append(proc)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".ds.tmp-*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert list(tmp_path.glob(".ds.tmp-*")), "the prepare never started writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert not out.exists()  # nothing under the dataset's name; the .tmp dir is hidden
    inspect = fsdpkit("data", "inspect", str(out), cwd=tmp_path)
    assert inspect.returncode == 1 and "not a prepared dataset" in inspect.stderr
    done = fsdpkit(*args, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert not list(tmp_path.glob(".ds.tmp-*"))  # the dead prepare's leftovers are gone


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("llamafactory/alpaca_en_demo.json", "alpaca instruction/input/output (3 rows)"),
        ("trl/standard_prompt_completion.jsonl", "prompt/completion (3 rows)"),
        ("qa/questions.json", "matches no data schema (keys: 'question', 'answer')"),
    ],
)
def test_sft_files_prepare_as_sft_or_are_refused(tmp_path: Path, name: str, needle: str) -> None:
    result = fsdpkit("data", "prepare", str(FIXTURES / name), "-o", "ds", cwd=tmp_path)
    assert needle in result.stdout + result.stderr
    assert result.returncode == (2 if "matches no" in needle else 0)


def test_help_config_documents_every_data_key(tmp_path: Path) -> None:
    from fsdpkit.config.docs import field_docs
    from fsdpkit.config.schema import DataConfig

    docs = field_docs(DataConfig)
    out = fsdpkit("train", "--help-config", cwd=tmp_path).stdout
    for key in ("path", "mix", "schema", "columns", "workers", "cache_dir", "max_bytes"):
        assert f"data.{key} =" in out and docs[key]


def test_train_on_a_prepared_dataset_says_what_it_trains_on(tmp_path: Path) -> None:
    (tmp_path / "corpus.txt").write_text(TEXT)
    assert fsdpkit("data", "prepare", "corpus.txt", "-o", "ds", cwd=tmp_path).returncode == 0
    fast = [a for a in FAST if not a.startswith("data.max_bytes")]
    run = fsdpkit(
        "train",
        "--nproc",
        "2",
        *fast,
        "data.path=ds",
        f"logging.run_dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    text = run.stdout + run.stderr
    assert "prepared dataset" in text and "documents" in text and "steps per epoch" in text
    assert not (tmp_path / "run" / "data").exists()  # mapped as it is, never re-prepared
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    data = [r["data"] for r in records if "data" in r]
    assert len(data) == 1 and records[0]["step"] == 0  # one, written before the first step
    assert data[0]["datasets"] == [str((tmp_path / "ds").resolve())] and data[0]["sft"] is False
    assert data[0]["train_sequences"] > 0 and data[0]["steps_per_epoch"] > 0


def test_prepare_help_shows_the_commands(tmp_path: Path) -> None:
    out = fsdpkit("data", "--help", cwd=tmp_path)
    assert out.returncode == 0 and "fsdpkit data prepare" in out.stdout
