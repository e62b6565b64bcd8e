"""The seeded permutation without a table, and ``data.mix``: exact shares, determinism,
a position that resumes the mixture exactly at another world size, and refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fsdpkit.config import DataConfig
from fsdpkit.data import DataError, open_training_data
from fsdpkit.data.mix import BLOCK, interleave, parse_mix, slot_counts
from fsdpkit.data.order import Permutation


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_permutation_is_a_bijection_fixed_by_seed_and_epoch(n: int) -> None:
    perm = Permutation(n, seed=5, epoch=2)
    out = perm(np.arange(n))
    assert sorted(out.tolist()) == list(range(n))
    assert np.array_equal(out, Permutation(n, seed=5, epoch=2)(np.arange(n)))
    if n > 16:
        assert not np.array_equal(out, Permutation(n, seed=5, epoch=3)(np.arange(n)))
        assert not np.array_equal(out, Permutation(n, seed=6, epoch=2)(np.arange(n)))


def test_permutation_of_billions_needs_no_table() -> None:
    perm = Permutation(5_000_000_000, seed=0, epoch=0)
    ids = perm(np.arange(4_999_999_000, 5_000_000_000))
    assert len(set(ids.tolist())) == 1000 and ids.max() < 5_000_000_000
    assert sum(k.nbytes for k in perm._keys) < 100


def test_parse_and_slot_counts() -> None:
    assert parse_mix(["a.jsonl@3", "b/", "c@d.txt"]) == [
        ("a.jsonl", 3.0),
        ("b/", 1.0),
        ("c@d.txt", 1.0),
    ]
    with pytest.raises(DataError, match="weight > 0"):
        parse_mix(["a@0"])
    counts = slot_counts([3, 1, 0.0001])
    assert sum(counts) == BLOCK and counts[2] == 1 and abs(counts[0] - 3 * counts[1]) <= 3
    source, rank = interleave([3, 1])
    assert source.tolist() == [0, 0, 1, 0] and rank.tolist() == [0, 1, 0, 2]


def _write(tmp_path: Path) -> tuple[str, str]:
    (tmp_path / "a.txt").write_text("".join(f"alpha {i} " for i in range(3000)))
    (tmp_path / "b.txt").write_text("".join(f"BETA {i} " for i in range(1000)))
    return str(tmp_path / "a.txt"), str(tmp_path / "b.txt")


def _open(
    cfg: DataConfig, tmp: Path, *, rank: int = 0, world: int = 1, micro: int = 4, accum: int = 2
) -> Any:
    return open_training_data(
        cfg,
        seed=1,
        micro_batch=micro,
        grad_accum=accum,
        dp_rank=rank,
        dp_world=world,
        eval_batches=2,
        work_dir=tmp / "run",
    )


def _source(rows: Any) -> list[str]:
    return ["b" if 65 <= int(r[0]) <= 90 or b"BETA" in bytes(r.tolist()) else "a" for r in rows]


def test_mixture_shares_resume_and_note(tmp_path: Path) -> None:
    a, b = _write(tmp_path)
    cfg = DataConfig(mix=[f"{a}@3", f"{b}@1"], seq_len=16)
    data = _open(cfg, tmp_path)
    assert "75.00% of sequences" in data.note and "25.00% of sequences" in data.note
    shares = [(m["path"], m["weight"], m["share"]) for m in data.record["mix"]]
    assert shares == [(str(a), 3.0, 0.75), (str(b), 1.0, 0.25)]  # as metrics.jsonl logs them
    rows = [r for _ in range(BLOCK // 8) for mb in data.loader.next_step() for r in mb]
    sources = _source(rows)
    assert sources.count("a") == 3 * sources.count("b")
    state = data.loader.state_dict()
    later = [r for _ in range(3) for mb in data.loader.next_step() for r in mb]
    two = [_open(cfg, tmp_path, rank=r, world=2, micro=2, accum=2) for r in range(2)]
    for loader in two:
        loader.loader.load_state_dict(state)
    again = []
    for _ in range(3):  # one step's rows, regrouped over the ranks in order
        steps = [d.loader.next_step() for d in two]
        for k in range(2):
            for rank in range(2):
                again += list(steps[rank][k])
    assert [r.tolist() for r in again] == [r.tolist() for r in later]
    assert len(data.val) == 2


def test_mixture_refuses_text_with_sft(tmp_path: Path) -> None:
    a, _ = _write(tmp_path)
    (tmp_path / "s.jsonl").write_text(json.dumps({"prompt": "q", "completion": "a"}) + "\n")
    with pytest.raises(DataError, match="mixes plain-text and SFT"):
        _open(DataConfig(mix=[a, str(tmp_path / "s.jsonl")], seq_len=16), tmp_path)
