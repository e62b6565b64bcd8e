"""``prepare``: shards and manifest, no-op reruns, changed inputs refused or rebuilt,
the same tokens at any worker count and piece size, damage found by ``inspect_dataset``,
the tokenizer check, and the memory a rank's data path holds."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from fsdpkit.config import DataConfig
from fsdpkit.data import DataError, check_tokenizer, host_bytes, inspect_dataset, prepare
from fsdpkit.data.dataset import PreparedDataset
from fsdpkit.data.manifest import Manifest, token_dtype

plan_module = importlib.import_module("fsdpkit.data.plan")
prepare_module = importlib.import_module("fsdpkit.data.prepare")  # the module, not the function
LINES = "".join(f"line {i}: the quick brown fox\n" for i in range(4000))  # ~124 kB


def _corpus(tmp_path: Path, n: int = 3) -> Path:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    for i in range(n):
        (src / f"f{i}.txt").write_text(f"doc {i}\n" + LINES[: 1000 * (i + 1)])
    return src


def _tokens(root: Path) -> np.ndarray:
    ds = PreparedDataset(root)
    return ds.tokens.read(0, len(ds.tokens))


def test_manifest_records_inputs_and_counts(tmp_path: Path) -> None:
    src = _corpus(tmp_path)
    done = prepare(DataConfig(), tmp_path / "ds", paths=[str(src)])
    m = Manifest.read(tmp_path / "ds")
    assert not done.reused and m.kind == "text" and m.dtype == "uint16"
    assert m.tokenizer["kind"] == "byte" and m.counts["documents"] == 3
    assert [Path(s["path"]).name for s in m.sources] == ["f0.txt", "f1.txt", "f2.txt"]
    assert all(len(s["sha256"]) == 64 and s["size"] > 0 for s in m.sources)
    text = bytes(_tokens(tmp_path / "ds").astype(np.uint8).tolist()).decode()
    assert text == "".join((src / f"f{i}.txt").read_text() + "\n\n" for i in range(3))
    assert m.fsdpkit_version and m.created
    assert (token_dtype(256), token_dtype(65536), token_dtype(128256)) == (
        "uint16",
        "uint16",
        "uint32",
    )


def test_rerun_is_a_noop_and_changes_are_refused_or_rebuilt(tmp_path: Path) -> None:
    src = _corpus(tmp_path)
    out = tmp_path / "ds"
    prepare(DataConfig(), out, paths=[str(src)])
    written = (out / "manifest.json").stat().st_mtime_ns
    again = prepare(DataConfig(), out, paths=[str(src)])
    assert again.reused and (out / "manifest.json").stat().st_mtime_ns == written
    os.utime(src / "f1.txt")  # touched, same bytes: the sha256 says unchanged
    assert prepare(DataConfig(), out, paths=[str(src)]).reused
    (src / "f1.txt").write_text("changed")
    with pytest.raises(DataError, match=r"f1\.txt changed size .*--rebuild"):
        prepare(DataConfig(), out, paths=[str(src)])
    with pytest.raises(DataError, match=r"data\.max_bytes \(None -> 10\)"):
        prepare(DataConfig(max_bytes=10), out, paths=[str(src)])
    rebuilt = prepare(DataConfig(), out, paths=[str(src)], rebuild=True)
    assert not rebuilt.reused and rebuilt.manifest.counts["documents"] == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ds.")]  # nothing left aside


def test_changed_tokenizer_is_refused_by_name(tmp_path: Path) -> None:
    from tiny_hf import write_tokenizer

    src = _corpus(tmp_path)
    tok = tmp_path / "tok"
    tok.mkdir()
    write_tokenizer(tok, vocab_size=300)
    prepare(DataConfig(), tmp_path / "ds", paths=[str(src)])
    with pytest.raises(DataError, match=r"the tokenizer \(byte -> .*tokenizer\.json\)"):
        prepare(DataConfig(tokenizer=str(tok)), tmp_path / "ds", paths=[str(src)])
    m = Manifest.read(tmp_path / "ds")
    with pytest.raises(DataError, match=r"byte-level tokenizer .* but the tokenizer .*tok"):
        check_tokenizer(m, tok, root=tmp_path / "ds")
    check_tokenizer(m, None)  # the same tokenizer: no error


def test_same_tokens_at_any_worker_count_and_piece_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tiny_hf import write_tokenizer

    tok = tmp_path / "tok"
    tok.mkdir()
    write_tokenizer(tok, vocab_size=300)
    src = tmp_path / "big.txt"
    src.write_text(LINES * 3)  # one document, ~370 kB
    cfg = DataConfig(tokenizer=str(tok))
    whole = _tokens(prepare(cfg, tmp_path / "one", paths=[str(src)]).path)
    monkeypatch.setattr(plan_module, "UNIT_BYTES", 50_000)
    monkeypatch.setattr(prepare_module, "SPAWN_S", 0.0)
    cut = prepare(DataConfig(tokenizer=str(tok), workers=2), tmp_path / "par", paths=[str(src)])
    assert len(cut.manifest.shards) > 4 and cut.manifest.counts["documents"] == 1
    np.testing.assert_array_equal(_tokens(cut.path), whole)  # cut after a newline: same ids


def test_max_bytes_cut_is_counted(tmp_path: Path) -> None:
    src = _corpus(tmp_path)
    done = prepare(DataConfig(max_bytes=1500), tmp_path / "ds", paths=[str(src)])
    c = done.manifest.counts
    assert c["source_bytes"] == 1500 and c["left_out_files"] == 1
    assert c["source_bytes"] + c["left_out_bytes"] == sum(f.stat().st_size for f in src.iterdir())


def test_validation_split_is_whole_documents(tmp_path: Path) -> None:
    src = _corpus(tmp_path, n=10)
    ds = PreparedDataset(prepare(DataConfig(), tmp_path / "ds", paths=[str(src)]).path)
    split = ds.split(0.2)
    assert split.val_docs == 2 and not split.by_tokens
    assert split.train_end == ds.doc_end(7)  # the first 8 documents train
    one = tmp_path / "one.txt"
    one.write_text(LINES)
    single = PreparedDataset(prepare(DataConfig(), tmp_path / "one", paths=[str(one)]).path)
    tail = single.split(0.1)
    assert tail.by_tokens and tail.train_end == len(single.tokens) - len(single.tokens) // 10


def test_inspect_finds_torn_missing_and_corrupt_shards(tmp_path: Path) -> None:
    root = prepare(DataConfig(), tmp_path / "ds", paths=[str(_corpus(tmp_path))]).path
    assert inspect_dataset(root, verify=True).ok
    tokens = root / "shard-00000.tokens"
    data = bytearray(tokens.read_bytes())
    data[10] ^= 0xFF
    tokens.write_bytes(bytes(data))
    info = inspect_dataset(root, verify=True)
    assert not info.ok and "crc32" in info.problems[0]
    tokens.write_bytes(bytes(data[:-2]))
    assert "shard-00000.tokens has" in inspect_dataset(root).problems[0]
    with pytest.raises(DataError, match="is damaged"):
        PreparedDataset(root)
    (root / "shard-00000.docs").unlink()
    assert any("docs is missing" in p for p in inspect_dataset(root).problems)
    (root / "manifest.json").write_text(json.dumps({"format": "other"}))
    assert not inspect_dataset(root).ok


def test_host_bytes_do_not_grow_with_a_text_corpus(tmp_path: Path) -> None:
    small = prepare(DataConfig(), tmp_path / "s", paths=[str(_corpus(tmp_path, n=2))]).path
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "a.txt").write_text(LINES * 20)
    big = prepare(DataConfig(), tmp_path / "b", paths=[str(tmp_path / "big")]).path
    a = host_bytes(DataConfig(path=str(small)), micro_batch=4)
    b = host_bytes(DataConfig(path=str(big)), micro_batch=4)
    assert a == b < 8 << 20


def test_an_unreadable_source_is_named_with_its_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _corpus(tmp_path)
    real = prepare_module.sha256_file

    def flaky(path: Path) -> str:
        if path.name == "f1.txt":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(prepare_module, "sha256_file", flaky)
    with pytest.raises(DataError, match=r"f1\.txt \(Permission denied\)"):
        prepare(DataConfig(), tmp_path / "ds", paths=[str(src)])
    assert not (tmp_path / "ds").exists()  # nothing half-written is left as the dataset
