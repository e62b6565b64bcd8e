"""Reading corpora: the built-in one, files, directories, globs, JSONL, and their errors.

Every document is followed by the separator (a blank line for the byte tokenizer), as
a prepared dataset stores it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fsdpkit.config import DataConfig
from fsdpkit.data import ByteTokenizer, DataError, build_tokenizer, load_token_stream
from fsdpkit.data.corpus import read_documents, stdlib_dir, stdlib_files

BYTES = ByteTokenizer()


def text(tokens: torch.Tensor) -> str:
    return BYTES.decode(tokens.tolist())


def test_builtin_corpus_is_nonempty_deterministic_and_bounded() -> None:
    cfg = DataConfig(max_bytes=300_000)
    first = load_token_stream(cfg, build_tokenizer(cfg))
    again = load_token_stream(cfg, build_tokenizer(cfg))
    assert first.dtype == torch.int64 and first.ndim == 1
    assert torch.equal(first, again)
    # max_bytes bounds the text; only the blank lines between documents come on top
    assert 250_000 < first.numel() < 300_000 + 2 * 1000
    assert "def " in text(first[:100_000])


def test_builtin_corpus_files_are_sorted_stdlib_sources() -> None:
    files = [f for _, f in zip(range(200), stdlib_files())]
    assert files and all(f.suffix == ".py" for f in files)
    assert files == sorted(files, key=lambda p: p.parts)
    inside = [f.relative_to(stdlib_dir()).parts for f in files]
    assert not any("site-packages" in parts or "test" in parts for parts in inside)


def test_byte_tokenizing_4mb_cuts_at_a_character(tmp_path: Path) -> None:
    (tmp_path / "big.txt").write_text("héllo wörld, " * 330_000)  # 15 bytes each, ~5 MB
    # 3_999_999 = 266_666 * 15 + 9: the budget ends inside the 2-byte 'ö' at offset 8
    cfg = DataConfig(path=str(tmp_path / "big.txt"), max_bytes=3_999_999)
    tokens = load_token_stream(cfg, BYTES)  # its speed: bench/wall_clock.py
    assert tokens.numel() == 3_999_998 + 2  # the cut character is dropped, not replaced
    assert "\ufffd" not in text(tokens[-100:])


def test_single_text_file(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello")
    assert text(load_token_stream(DataConfig(path=str(tmp_path / "a.txt")), BYTES)) == "hello\n\n"


def test_directory_recursive_sorted_text_files_only(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.md").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "c.py").write_text("third")
    (tmp_path / "d.bin").write_bytes(b"\x00\x01")  # not a text suffix
    (tmp_path / ".hidden.txt").write_text("hidden")
    (tmp_path / "e.jsonl").write_text(json.dumps({"text": "fourth"}) + "\n")
    tokens = load_token_stream(DataConfig(path=str(tmp_path)), BYTES)
    assert text(tokens) == "first\n\nsecond\n\nthird\n\nfourth\n\n"


def test_glob_pattern(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "2.txt").write_text("two")
    (tmp_path / "1.txt").write_text("one")
    (tmp_path / "skip.md").write_text("no")
    tokens = load_token_stream(DataConfig(path=str(tmp_path / "**" / "*.txt")), BYTES)
    assert text(tokens) == "one\n\ntwo\n\n"


def test_jsonl_text_field_and_blank_lines(tmp_path: Path) -> None:
    lines = [json.dumps({"body": "alpha", "id": 1}), "", json.dumps({"body": "beta"})]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    cfg = DataConfig(path=str(tmp_path / "d.jsonl"), text_field="body")
    assert read_documents(cfg) == ["alpha", "beta"]


def test_max_bytes_spans_files(tmp_path: Path) -> None:
    for name in ("a.txt", "b.txt", "c.txt"):
        (tmp_path / name).write_text(name[0] * 10)
    assert read_documents(DataConfig(path=str(tmp_path), max_bytes=15)) == ["a" * 10, "b" * 5]


def test_missing_path_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data\.path: .*nope\.txt does not exist"):
        read_documents(DataConfig(path=str(tmp_path / "nope.txt")))


def test_glob_matching_nothing(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"glob pattern .*\*\.txt.* matches no data files"):
        read_documents(DataConfig(path=str(tmp_path / "*.txt")))


def test_directory_without_text_files(tmp_path: Path) -> None:
    (tmp_path / "x.bin").write_bytes(b"1")
    with pytest.raises(DataError, match="has no data files"):
        read_documents(DataConfig(path=str(tmp_path)))


def test_empty_data(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match=r"data\.path \(.*empty\.txt\) holds no text"):
        load_token_stream(DataConfig(path=str(tmp_path / "empty.txt")), BYTES)


def test_jsonl_line_that_is_not_json(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n{oops\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not valid JSON"):
        read_documents(DataConfig(path=str(path)))


@pytest.mark.parametrize("record", [{"content": "x"}, {"text": 3}, ["text"]])
def test_jsonl_record_without_text_field(tmp_path: Path, record: object) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n" + json.dumps(record) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:2: .*'text'.*data\.text_field"):
        read_documents(DataConfig(path=str(path)))
