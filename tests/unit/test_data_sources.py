"""Sources beyond plain text: parquet and ``datasets.save_to_disk`` Arrow round trips,
a Hub-style dataset repository (train split by file name), .jsonl.gz / .jsonl.zst, and
their errors. Rows go through ``datasets`` exactly as a user would write them."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from fsdpkit.config import DataConfig
from fsdpkit.data import ByteTokenizer, DataError, load_token_stream, read_documents
from fsdpkit.data.plan import data_kind
from fsdpkit.data.sources import resolve
from fsdpkit.data.work import load_examples

datasets = pytest.importorskip("datasets")
ROWS = [{"prompt": f"Q{i}: ", "completion": f"answer {i}"} for i in range(5)]
TEXTS = [{"text": f"document number {i}", "id": i} for i in range(4)]


def _sft(path: Path | str, **kw: object) -> list[bytes]:
    examples, _ = load_examples(DataConfig(path=str(path), **kw), ByteTokenizer())
    return [bytes(ex.ids[ex.train].tolist()) for ex in examples]


def test_parquet_round_trip_sft_and_text(tmp_path: Path) -> None:
    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "sft.parquet"))
    assert data_kind(DataConfig(path=str(tmp_path / "sft.parquet"))) == "sft"
    assert _sft(tmp_path / "sft.parquet") == [f"answer {i}".encode() for i in range(5)]
    datasets.Dataset.from_list(TEXTS).to_parquet(str(tmp_path / "text.parquet"))
    docs = read_documents(DataConfig(path=str(tmp_path / "text.parquet")))
    assert docs == [r["text"] for r in TEXTS]


def test_save_to_disk_round_trip(tmp_path: Path) -> None:
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    assert _sft(tmp_path / "saved") == [f"answer {i}".encode() for i in range(5)]
    both = datasets.DatasetDict(
        train=datasets.Dataset.from_list(TEXTS), test=datasets.Dataset.from_list(TEXTS[:1])
    )
    both.save_to_disk(str(tmp_path / "dict"))
    found = resolve(str(tmp_path / "dict"))
    assert all("train" in s.path.parts for s in found.sources)
    assert found.left_out and "test" in found.left_out[0]
    assert read_documents(DataConfig(path=str(tmp_path / "dict"))) == [r["text"] for r in TEXTS]


def test_hub_repository_layout_reads_the_train_split(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    (repo / "README.md").write_text("---\nconfigs: ...\n---\n# my dataset\n")
    datasets.Dataset.from_list(TEXTS[:2]).to_parquet(
        str(repo / "data" / "train-00000-of-00002.parquet")
    )
    datasets.Dataset.from_list(TEXTS[2:]).to_parquet(
        str(repo / "data" / "train-00001-of-00002.parquet")
    )
    datasets.Dataset.from_list(TEXTS[:1]).to_parquet(
        str(repo / "data" / "test-00000-of-00001.parquet")
    )
    found = resolve(str(repo))
    assert [s.path.name for s in found.sources] == [
        "train-00000-of-00002.parquet",
        "train-00001-of-00002.parquet",
    ]
    assert any("README.md" in n for n in found.left_out)
    assert any("test" in n for n in found.left_out)
    tokens = load_token_stream(DataConfig(path=str(repo)))
    assert bytes(tokens.tolist()).decode() == "".join(r["text"] + "\n\n" for r in TEXTS)


def test_compressed_jsonl(tmp_path: Path) -> None:
    zstd = pytest.importorskip("zstandard")
    body = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(body))
    (tmp_path / "b.jsonl.zst").write_bytes(zstd.ZstdCompressor().compress(body))
    for name in ("a.jsonl.gz", "b.jsonl.zst"):
        assert _sft(tmp_path / name) == [f"answer {i}".encode() for i in range(5)]


def test_bad_rows_name_the_row(tmp_path: Path) -> None:
    rows = [*ROWS[:3], {"prompt": "Q", "completion": ""}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "bad.parquet"))
    with pytest.raises(DataError, match=r"bad\.parquet: row 3: the completion is empty"):
        _sft(tmp_path / "bad.parquet")
    (tmp_path / "bad.json").write_text(json.dumps([*ROWS[:2], {"prompt": "Q", "completion": 1}]))
    with pytest.raises(DataError, match=r"bad\.json: record 2: 'prompt' and 'completion'"):
        _sft(tmp_path / "bad.json")


def test_table_without_the_text_column_names_the_columns(tmp_path: Path) -> None:
    datasets.Dataset.from_list([{"body": "x", "id": 1}]).to_parquet(str(tmp_path / "t.parquet"))
    with pytest.raises(
        DataError,
        match=r"t\.parquet: row 0: the record matches no data schema \(keys: 'body', 'id'\)",
    ):
        load_token_stream(DataConfig(path=str(tmp_path / "t.parquet")))
    with pytest.raises(DataError, match=r"no column 'text' \(columns: body, id\)"):
        read_documents(DataConfig(path=str(tmp_path / "t.parquet")))
    docs = read_documents(DataConfig(path=str(tmp_path / "t.parquet"), text_field="body"))
    assert docs == ["x"]


def test_missing_extra_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    datasets.Dataset.from_list(TEXTS).to_parquet(str(tmp_path / "t.parquet"))
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(DataError, match=r"pip install 'fsdpkit\[data\]'"):
        read_documents(DataConfig(path=str(tmp_path / "t.parquet")))
