"""The data pipeline on 2 gloo ranks: a prepared dataset trains the same losses as the
same sources through the raw path (prepared once into the run's cache, under a lock
both ranks take); the data position resumes exactly at another world size (text and
SFT); a tokenizer that is not the dataset's (model.hf's) is refused by name on every
rank."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdpkit import build_mesh, shard
from fsdpkit.config import DataConfig, ModelConfig, RunConfig
from fsdpkit.data import DataError, open_training_data, prepare
from fsdpkit.testing import run_ranks
from support import TINY, build, lm_loss

pytestmark = pytest.mark.distributed

SEQ = 16
TEXT = "".join(f"{i} little pigs went to market, {i * 7 % 13} came home.\n" for i in range(600))


def _open(cfg: DataConfig, rank: int, world: int, work: Path, *, micro: int, accum: int) -> Any:
    return open_training_data(
        cfg,
        seed=3,
        micro_batch=micro,
        grad_accum=accum,
        dp_rank=rank,
        dp_world=world,
        eval_batches=2,
        work_dir=work,
    )


def _losses(rank: int, world: int, cfg: DataConfig, work: Path) -> list[float]:
    data = _open(cfg, rank, world, work, micro=2, accum=2)
    model = build(dataclasses.replace(TINY, vocab_size=256), seed=0)
    shard(model, RunConfig(), mesh=build_mesh(device_type="cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, eps=1e-6)
    out = []
    for _ in range(4):
        total = torch.zeros(())
        for tokens in data.loader.next_step():
            loss = lm_loss(model, tokens) / 2
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        out.append(float(total) / world)
    return out


def _train_both(rank: int, world: int, tmp: str) -> dict[str, list[float]]:
    root = Path(tmp)
    raw = DataConfig(path=str(root / "corpus"), seq_len=SEQ)
    prepared = DataConfig(path=str(root / "ds"), seq_len=SEQ)
    return {
        "raw": _losses(rank, world, raw, root / "run-raw"),
        "prepared": _losses(rank, world, prepared, root / "run-prepared"),
    }


def test_prepared_dataset_trains_the_same_losses_as_the_raw_path(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"part{i}.txt").write_text(TEXT[i * 5000 : (i + 1) * 5000])
    prepare(DataConfig(), tmp_path / "ds", paths=[str(corpus)])
    ranks = run_ranks(_train_both, world_size=2, args=(str(tmp_path),))
    assert ranks[0] == ranks[1]
    torch.testing.assert_close(ranks[0]["raw"], ranks[0]["prepared"], rtol=0, atol=1e-6)
    assert (tmp_path / "run-raw" / "data" / "train" / "manifest.json").is_file()
    assert not (tmp_path / "run-prepared" / "data" / "train").exists()  # mapped, not copied


def _steps(data: Any, world: int, steps: int) -> list[list[tuple[int, ...]]]:
    """The rows (first tokens) of ``steps`` global steps, gathered from every rank."""
    out = []
    for _ in range(steps):
        step = [_key(b) for b in data.loader.next_step()]
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, step)
        out.append(sorted(x for rank_rows in gathered for mb in rank_rows for x in mb))
    return out


def _positions(rank: int, world: int, tmp: str, states: Any) -> dict[str, Any]:
    """Per kind (text, sft): at world 2, 7 steps and the position after 3; at world 1,
    4 steps from ``states``. The global batch is 8 either way."""
    micro, accum = (2, 2) if world == 2 else (2, 4)
    out: dict[str, Any] = {}
    for kind in ("text", "sft"):
        cfg = _cfg(Path(tmp), sft=kind == "sft")
        data = _open(cfg, rank, world, Path(tmp) / "run" / kind, micro=micro, accum=accum)
        if states is None:
            out[kind] = _steps(data, world, 7)
            again = _open(cfg, rank, world, Path(tmp) / "run" / kind, micro=micro, accum=accum)
            _steps(again, world, 3)
            out[kind + "-state"] = again.loader.state_dict()
        else:
            data.loader.load_state_dict(states[kind + "-state"])
            out[kind] = _steps(data, world, 4)
    return out


def _key(batch: Any) -> list[tuple[int, ...]]:
    tokens = batch.inputs if hasattr(batch, "inputs") else batch
    return [tuple(row.tolist()) for row in tokens]


def _cfg(root: Path, *, sft: bool) -> DataConfig:
    if sft:
        return DataConfig(path=str(root / "sft.jsonl"), seq_len=SEQ, val_fraction=0.0)
    return DataConfig(path=str(root / "corpus.txt"), seq_len=SEQ)


def test_resume_at_another_world_size_continues_exactly(tmp_path: Path) -> None:
    rng = random.Random(0)  # no two sequences alike, so a repeat would show
    (tmp_path / "corpus.txt").write_text("".join(rng.choice("abcdefgh \n") for _ in range(20000)))
    rows = [{"prompt": f"q{i}:", "completion": f" a{i * 3}" * (1 + i % 4)} for i in range(300)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    whole = run_ranks(_positions, world_size=2, args=(str(tmp_path), None))[0]
    assert whole["text-state"] == {"epoch": 0, "consumed": 24}
    resumed = run_ranks(_positions, world_size=1, args=(str(tmp_path), whole))[0]
    for kind in ("text", "sft"):
        assert resumed[kind] == whole[kind][3:]
        assert len({row for step in whole[kind] for row in step}) == 7 * 8  # no repeats


def _refused(rank: int, world: int, tmp: str) -> str:
    from fsdpkit.models.hf.directory import with_model_tokenizer

    root = Path(tmp)
    cfg = RunConfig(
        model=ModelConfig(hf=str(root / "model")), data=DataConfig(path=str(root / "ds"))
    )
    cfg = with_model_tokenizer(cfg)
    try:
        _open(cfg.data, rank, world, root / "run", micro=1, accum=1)
    except DataError as exc:
        return str(exc)
    return "not refused"


def test_tokenizer_mismatch_with_model_hf_is_refused_by_name(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tiny_hf import write_tiny_model

    write_tiny_model(tmp_path / "model", arch="llama", dim=32, weights=False)
    (tmp_path / "corpus.txt").write_text(TEXT)
    prepare(DataConfig(), tmp_path / "ds", paths=[str(tmp_path / "corpus.txt")])  # byte-level
    messages = run_ranks(_refused, world_size=2, args=(str(tmp_path),))
    assert messages[0] == messages[1]
    assert str(tmp_path / "ds") in messages[0] and "byte-level tokenizer" in messages[0]
    assert str(tmp_path / "model" / "tokenizer.json") in messages[0]
