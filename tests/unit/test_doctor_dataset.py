"""The doctor and the planner know the data (issue 21, item 8): a prepared data.path is
checked whole (manifest, shards, crc32) and against the run's tokenizer; the plan
counts the data path's host memory, which does not grow with a prepared text corpus."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from fsdpkit.config import DataConfig, load
from fsdpkit.data import prepare
from fsdpkit.doctor.data_check import dataset_checks
from fsdpkit.planner import plan


def _corpus(path: Path, *, docs: int) -> Path:
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon"]
    path.write_text("\n".join(" ".join(rng.choices(words, k=60)) for _ in range(docs)))
    return path


@pytest.fixture()
def dataset(tmp_path: Path) -> Path:
    source = _corpus(tmp_path / "corpus.txt", docs=200)
    return prepare(DataConfig(path=str(source)), tmp_path / "prepared", progress=False).path


def test_an_intact_dataset_passes_and_is_summarized(dataset: Path) -> None:
    (check,) = dataset_checks(load(None, [f"data.path={dataset}"]))
    assert check.status == "ok" and "tokens, intact" in check.message, check


def test_a_corrupt_shard_fails_by_name(dataset: Path) -> None:
    shard = next(dataset.glob("*.tokens"))
    raw = bytearray(shard.read_bytes())
    raw[10:14] = b"XYZW"
    shard.write_bytes(bytes(raw))
    (check,) = dataset_checks(load(None, [f"data.path={dataset}"]))
    assert check.status == "fail" and shard.name in check.message and "corrupt" in check.message


def test_a_tokenizer_mismatch_with_model_hf_fails_naming_both(
    dataset: Path, tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    from tiny_hf import write_tiny_model

    model = write_tiny_model(tmp_path / "hf", vocab_size=300)
    (check,) = dataset_checks(load(None, [f"data.path={dataset}", f"model.hf={model}"]))
    assert check.status == "fail", check
    assert "byte-level" in check.message and str(model / "tokenizer.json") in check.message


def test_raw_sources_are_named_as_prepared_at_start(tmp_path: Path) -> None:
    source = _corpus(tmp_path / "raw.txt", docs=5)
    (check,) = dataset_checks(load(None, [f"data.path={source}"]))
    assert check.status == "ok" and "raw sources" in check.message
    assert "fsdpkit data prepare" in check.fix


def test_plan_counts_the_data_path_and_it_does_not_grow_with_the_corpus(tmp_path: Path) -> None:
    small = prepare(
        DataConfig(path=str(_corpus(tmp_path / "s.txt", docs=50))), tmp_path / "s", progress=False
    ).path
    large = prepare(
        DataConfig(path=str(_corpus(tmp_path / "l.txt", docs=5000))), tmp_path / "l", progress=False
    ).path
    planned = {
        name: plan(load(None, [f"data.path={root}"]), world_size=2).data_host_bytes
        for name, root in (("small", small), ("large", large))
    }
    assert planned["small"] > 0
    assert planned["large"] == planned["small"]  # mapped shards: nothing per token
