"""``batch_split`` (fsdpkit.config.batch_split): one optimizer step of ``train.global_batch_size``
sequences at any data-parallel world size, the error that names the fix, and the
planner and recommender using the same split."""

from __future__ import annotations

import pytest

from fsdpkit.config import ConfigError, TrainConfig, batch_split, load
from fsdpkit.planner.search.recommend import _micro_changes
from fsdpkit.planner.shapes.scenario import scenario


def test_global_batch_splits_the_same_step_over_any_world_size() -> None:
    train = TrainConfig(global_batch_size=12, micro_batch_size=4)
    splits = {w: batch_split(train, dp_world=w) for w in (1, 2, 3, 4, 6, 12)}
    assert {w: (s.micro_batch, s.grad_accum) for w, s in splits.items()} == {
        1: (4, 3),
        2: (3, 2),
        3: (4, 1),
        4: (3, 1),
        6: (2, 1),
        12: (1, 1),
    }
    assert {s.global_batch for s in splits.values()} == {12}
    unset = batch_split(TrainConfig(micro_batch_size=4, grad_accum=2), dp_world=3)
    assert (unset.global_batch, unset.micro_batch, unset.grad_accum) == (24, 4, 2)


def test_a_global_batch_that_does_not_split_names_the_fix() -> None:
    with pytest.raises(ConfigError) as e:
        batch_split(TrainConfig(global_batch_size=8), dp_world=3)
    assert "train.global_batch_size = 8" in str(e.value) and "1, 2, 4, 8" in str(e.value)
    with pytest.raises(ConfigError, match=r"train\.grad_accum"):
        batch_split(TrainConfig(global_batch_size=8, grad_accum=2), dp_world=2)
    with pytest.raises(ConfigError, match="global_batch_size"):
        load(None, ["train.global_batch_size=0"])


def test_planner_and_recommender_use_the_same_split() -> None:
    cfg = load(None, ["train.global_batch_size=12", "train.micro_batch_size=4"])
    for world in (2, 3, 4):
        sc = scenario(cfg, world_size=world)
        split = batch_split(cfg.train, dp_world=world)
        assert (sc.micro_batch, sc.grad_accum) == (split.micro_batch, split.grad_accum)
    choices = _micro_changes(cfg, world=2)  # per rank 6: caps 1, 2, 3, 6
    assert choices == [{"train.micro_batch_size": m} for m in (1, 2, 3, 6)]
