"""Bad input: a non-zero exit within seconds and one paragraph naming the problem."""

from __future__ import annotations

from pathlib import Path

import pytest
from clirun import FAST, fsdpkit

pytestmark = pytest.mark.e2e


def _fails(tmp_path: Path, *args: str, expect: list[str], code: int = 2) -> str:
    result = fsdpkit(
        "train", *args, f"logging.run_dir={tmp_path / 'run'}", cwd=tmp_path, timeout=90
    )
    assert result.returncode == code, (result.returncode, result.stderr[-3000:])
    err = result.stderr
    for text in expect:
        assert text in err, err[-3000:]
    assert err.count("error") >= 1
    return err


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["train.stesp=5"], ["train.stesp", "train.steps" if False else "'steps'"]),
        (["train.steps=many"], ["train.steps", "wrong type"]),
        (["parallel.strategy=zero3"], ["parallel.strategy", "valid choice"]),
        (["parallel.strategy=hybrid", "parallel.shard_degree=3"], ["shard_degree", "world size"]),
        (["offload.params=true", "parallel.strategy=grad_op"], ["offload.params"]),
        (["precision.mode=fp16", "precision.grad_scaler=false"], ["grad_scaler"]),
    ],
)
def test_config_errors_before_launch(tmp_path: Path, args: list[str], expect: list[str]) -> None:
    err = _fails(tmp_path, *args, expect=expect)
    assert "Traceback" not in err


def test_missing_config_file(tmp_path: Path) -> None:
    _fails(tmp_path, "nope.toml", expect=["nope.toml", "does not exist"])


def test_missing_data_path(tmp_path: Path) -> None:
    err = _fails(tmp_path, *FAST, "data.path=/no/such/corpus.txt", expect=["/no/such/corpus.txt"])
    assert "Traceback" not in err
    assert err.count("/no/such/corpus.txt") <= 2  # printed once, not once per rank


def test_empty_data(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    _fails(tmp_path, *FAST, f"data.path={empty}", expect=["empty.txt"])


def test_factory_that_does_not_import(tmp_path: Path) -> None:
    _fails(
        tmp_path,
        *FAST,
        "model.factory=no_such_pkg.models:build",
        expect=["model.factory", "no_such_pkg.models"],
    )


def test_unknown_block_class(tmp_path: Path) -> None:
    _fails(
        tmp_path,
        *FAST,
        "parallel.block_classes=Transformerblock",
        expect=["parallel.block_classes", "DecoderLayer"],
    )


def test_a_rank_that_raises_stops_every_rank(tmp_path: Path) -> None:
    err = _fails(
        tmp_path,
        *FAST,
        "model.factory=factories:exploding",
        expect=["rank 1", "injected failure on rank 1", "step 3"],
        code=1,
    )
    assert "error on rank 0" not in err  # the peer's "connection closed" is not shown
    assert err.count("Traceback") == 1


def test_compile_without_a_cpu_compiler_fails_before_launch(tmp_path: Path) -> None:
    result = fsdpkit(
        "train",
        *FAST,
        "train.compile=true",
        f"logging.run_dir={tmp_path / 'run'}",
        cwd=tmp_path,
        timeout=90,
        env={"CXX": "no-such-cxx"},
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "C++ compiler (no-such-cxx) is not on PATH" in result.stderr
    assert "train.compile = false" in result.stderr and "Traceback" not in result.stderr
    assert "`fsdpkit doctor` runs the same check: 'compile'" in result.stderr
    assert not (tmp_path / "run").exists()  # refused before the run dir was made


def test_sft_rows_too_long_for_seq_len_say_why_on_every_rank(tmp_path: Path) -> None:
    """Every prompt is longer than a row (2 ranks, the default): each rank's error (the
    launcher shows one,
    not necessarily rank 0's) says how many examples were cut and dropped and which key
    to raise, not only that zero rows are fewer than a step needs."""
    import json

    rows = [{"prompt": "p" * (40 + i), "completion": "done"} for i in range(6)]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    expect = [
        "packs into 0 rows of data.seq_len 16",
        "of 6 example(s), 6 are longer than data.seq_len + 1 = 17 tokens",
        "6 were then dropped",
        "raise data.seq_len",
    ]
    err = _fails(tmp_path, *FAST, f"data.path={path}", "data.seq_len=16", expect=expect)
    assert "Traceback" not in err
