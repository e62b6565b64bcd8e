"""Tokenizers: byte-level, a locally built Hugging Face tokenizer.json, and their errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fsdpkit.config import DataConfig
from fsdpkit.data import ByteTokenizer, DataError, build_tokenizer, load_token_stream

WORDS = ["the cat sat on the mat", "a dog ate the bone", "hello world"]


def make_tokenizer_json(directory: Path, *, specials: tuple[str, ...] = ("[UNK]", "</s>")) -> Path:
    """Train a tiny word-level tokenizer on a few strings and save it (no download)."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=list(specials))
    tok.train_from_iterator(WORDS, trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


def test_byte_tokenizer_round_trip_and_replacement() -> None:
    tok = build_tokenizer(DataConfig())
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256 and tok.eos_id is None
    assert tok.encode("hé") == [104, 195, 169]
    assert tok.decode(tok.encode("naïve ✓")) == "naïve ✓"
    assert tok.decode([104, 195]) == "h\ufffd"


@pytest.mark.parametrize("point_at", ["dir", "file"])
def test_hf_tokenizer_from_dir_or_file(tmp_path: Path, point_at: str) -> None:
    file = make_tokenizer_json(tmp_path / "tok")
    tok = build_tokenizer(DataConfig(tokenizer=str(file.parent if point_at == "dir" else file)))
    assert tok.vocab_size == 2 + len(set(" ".join(WORDS).split()))
    assert tok.eos_id == 1  # "</s>" found among well-known EOS tokens
    ids = tok.encode("the cat ate")
    assert len(ids) == 3 and tok.decode(ids) == "the cat ate"


def test_hf_stream_ends_documents_with_eos(tmp_path: Path) -> None:
    tok = build_tokenizer(DataConfig(tokenizer=str(make_tokenizer_json(tmp_path / "tok"))))
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": w}) for w in WORDS[:2]))
    tokens = load_token_stream(DataConfig(path=str(data)), tok)
    expected = [*tok.encode(WORDS[0]), tok.eos_id, *tok.encode(WORDS[1]), tok.eos_id]
    assert tokens.dtype == torch.int64 and tokens.tolist() == expected


def test_hf_eos_from_tokenizer_config(tmp_path: Path) -> None:
    file = make_tokenizer_json(tmp_path, specials=("[UNK]", "<end>", "</s>"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<end>"}}))
    assert build_tokenizer(DataConfig(tokenizer=str(file))).eos_id == 1


def test_hf_without_eos_separates_with_blank_line(tmp_path: Path) -> None:
    tok = build_tokenizer(
        DataConfig(tokenizer=str(make_tokenizer_json(tmp_path / "t", specials=("[UNK]",))))
    )
    assert tok.eos_id is None
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "b.txt").write_text("world")
    tokens = load_token_stream(DataConfig(path=str(tmp_path / "*.txt")), tok)
    sep = tok.encode("\n\n")
    assert tokens.tolist() == tok.encode("hello") + sep + tok.encode("world") + sep


def test_user_tokenizer_without_bulk_path(tmp_path: Path) -> None:
    class Upper:
        vocab_size = 256
        eos_id: int | None = 0

        def encode(self, text: str) -> list[int]:
            return list(text.upper().encode())

        def decode(self, ids: list[int]) -> str:
            return bytes(ids).decode()

    (tmp_path / "a.txt").write_text("ab")
    (tmp_path / "b.txt").write_text("c")
    tokens = load_token_stream(DataConfig(path=str(tmp_path)), Upper())
    assert tokens.tolist() == [65, 66, 0, 67, 0]


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data\.tokenizer: .*nope\.json does not exist"):
        build_tokenizer(DataConfig(tokenizer=str(tmp_path / "nope.json")))


def test_directory_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data\.tokenizer: directory .* has no tokenizer\.json"):
        build_tokenizer(DataConfig(tokenizer=str(tmp_path)))


def test_unreadable_tokenizer_json(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"')
    with pytest.raises(DataError, match=r"tokenizer\.json could not be read"):
        build_tokenizer(DataConfig(tokenizer=str(tmp_path)))


def test_tokenizers_not_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes the import fail
    with pytest.raises(DataError, match="pip install tokenizers"):
        build_tokenizer(DataConfig(tokenizer=str(tmp_path)))


def _with_bos_post_processor(file: Path, bos: str = "<s>") -> None:
    """Give a saved tokenizer.json Llama's post-processor: BOS before every text."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(file))
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    tok.save(str(file))


def test_bos_is_what_the_tokenizers_own_encode_adds(tmp_path: Path) -> None:
    """[Note: special tokens]: the tokenizer.json post-processor's BOS; an
    ``add_bos_token`` in tokenizer_config.json changes nothing (transformers 5 drops it
    when there is a tokenizer.json)."""
    file = make_tokenizer_json(tmp_path, specials=("[UNK]", "<s>", "</s>"))
    assert build_tokenizer(DataConfig(tokenizer=str(file))).bos_ids == ()  # type: ignore[attr-defined]
    _with_bos_post_processor(file)
    tok = build_tokenizer(DataConfig(tokenizer=str(file)))
    assert tok.bos_ids == (1,) and tok.fingerprint()["bos_ids"] == [1]  # type: ignore[attr-defined]
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"add_bos_token": False, "bos_token": "<s>"}))
    assert build_tokenizer(DataConfig(tokenizer=str(file))).bos_ids == (1,)  # type: ignore[attr-defined]


def test_bos_once_and_eos_once(tmp_path: Path) -> None:
    """BOS before a text unless it starts with it, EOS after unless it ends with it: a
    text stream's documents and string rows never get two of either."""
    from fsdpkit.data.tokenizer import document_ids, with_bos, with_eos

    file = make_tokenizer_json(tmp_path / "t", specials=("[UNK]", "<s>", "</s>"))
    _with_bos_post_processor(file)
    tok = build_tokenizer(DataConfig(tokenizer=str(file)))
    cat = np.asarray(tok.encode("the cat"))
    assert with_bos(tok, cat).tolist() == [1, *cat.tolist()]
    assert with_bos(tok, with_bos(tok, cat)).tolist() == [1, *cat.tolist()]
    assert with_eos(tok, with_eos(tok, cat)).tolist() == [*cat.tolist(), 2]
    assert document_ids(tok, np.asarray(tok.encode("<s> the cat </s>"))).tolist() == [
        1,
        *cat.tolist(),
        2,
    ]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in ("the cat", "a dog </s>", "")))
    stream = load_token_stream(DataConfig(path=str(data)), tok).tolist()
    assert stream == [1, *cat.tolist(), 2, 1, *tok.encode("a dog"), 2]
