"""One source of truth: the registries the config, shard() and the planner share, the
one TOML writer, ``with_changes`` and ``resolve``."""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from pathlib import Path

import pytest
import torch

from fsdpkit import config as c
from fsdpkit.config import ConfigError
from fsdpkit.config.parallel import StrategyName
from fsdpkit.config.schema import PrecisionMode
from fsdpkit.config.toml import dump_tables, toml_value
from fsdpkit.devices import DEVICES, _from_name, device_from
from fsdpkit.models.flops import flops_per_token
from fsdpkit.models.llama import preset
from fsdpkit.precision import AUTO, PRESETS
from fsdpkit.precision import preset_for as resolve_preset
from fsdpkit.run.resolve import resolve
from fsdpkit.strategies import STRATEGIES


def test_names_are_spelled_once() -> None:
    assert set(typing.get_args(StrategyName)) == set(STRATEGIES)
    assert set(typing.get_args(PrecisionMode)) == {AUTO, *PRESETS}


def test_strategy_records() -> None:
    assert STRATEGIES["full"].mesh_shape(world_size=8, shard_degree=None) == (1, 8)
    assert STRATEGIES["replicate"].mesh_shape(world_size=8, shard_degree=None) == (8, 1)
    assert STRATEGIES["hybrid"].mesh_shape(world_size=8, shard_degree=4) == (2, 4)
    with pytest.raises(ConfigError, match="does not divide the world size 8"):
        STRATEGIES["hybrid_grad_op"].mesh_shape(world_size=8, shard_degree=3)
    assert [s for s in STRATEGIES if STRATEGIES[s].allows_offload] == ["full", "hybrid"]
    assert STRATEGIES["hybrid"].collectives == ("all_gather", "reduce_scatter", "all_reduce")


def test_precision_presets_resolve_auto_and_scaler() -> None:
    assert resolve_preset("auto", bf16_device=True).name == "bf16"
    assert resolve_preset("auto", bf16_device=False).name == "fp32"
    assert (PRESETS["bf16"].param_bytes, PRESETS["bf16"].reduce_bytes) == (2, 4)
    assert resolve_preset("bf16", bf16_device=False, grad_scaler=True).scaler
    assert PRESETS["fp16"].policy().param_dtype == torch.float16


def test_toml_writer_round_trips_every_value() -> None:
    tricky = ['a "quoted" word', "back\\slash", "tab\tnew\nline", "bell\x07", "ünï"]
    values = {"s": tricky, "i": -3, "f": 1e-8, "b": False, "t": {"x y": [1, 2], "z": "q"}}
    assert tomllib.loads(dump_tables({"sec": values}))["sec"] == values
    assert toml_value(float("inf")) == "inf"


def test_resolved_config_round_trips_through_toml(tmp_path: Path) -> None:
    cfg = c.load(None, ['data.path=dir/with "quotes" and \\ back', "parallel.block_classes=A,B"])
    path = tmp_path / "config.toml"
    path.write_text(c.to_toml(cfg))
    assert c.load(path) == cfg


def test_optional_fields_default_to_none() -> None:
    """A None written as a comment reads back as the default: only sound if every
    optional field defaults to None."""
    for cls in c.SECTIONS.values():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if type(None) in typing.get_args(hints[f.name]):
                assert f.default is None, (cls.__name__, f.name)


def test_configs_are_frozen_and_changed_with_validation() -> None:
    cfg = c.load()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.parallel.strategy = "hybrid"  # type: ignore[misc]
    new = c.with_changes(cfg, {"parallel.strategy": "grad_op", "train.steps": 7})
    assert (new.parallel.strategy, new.train.steps, cfg.train.steps) == ("grad_op", 7, 300)
    with pytest.raises(ConfigError, match="offload"):
        c.with_changes(new, {"offload.params": True})
    with pytest.raises(ConfigError, match="Did you mean 'steps'"):
        c.with_changes(cfg, {"train.stepz": 1})


def test_resolve_applies_parallel_auto_once_and_checks_the_world() -> None:
    off = resolve(None, ["train.steps=3"], world_size=2, local_world_size=2)
    assert off.auto_changes is None and off.config.train.steps == 3
    auto = resolve(
        None,
        ["parallel.auto=true", "parallel.device_mem=cpu:64GiB", "model.n_layers=2"],
        world_size=2,
        local_world_size=2,
    )
    assert auto.auto_changes is not None and auto.config.parallel.auto is False
    assert c.with_changes(auto.config, {}) == auto.config
    with pytest.raises(ConfigError, match="must divide the shard group size"):
        resolve(None, ["parallel.reshard_after_forward=3"], world_size=4, local_world_size=4)


def test_one_flops_formula() -> None:
    shape = preset("llama3-8b")
    assert shape.flops_per_token(8192) == flops_per_token(
        matmul_params=shape.num_params() - shape.vocab_size * shape.dim,
        n_layers=32,
        n_heads=32,
        head_dim=128,
        seq_len=8192,
    )


def test_one_device_table() -> None:
    h100 = _from_name("NVIDIA H100 80GB HBM3", memory=85_000_000_000)
    assert (
        h100 is not None and h100.name == "h100" and h100.peak_flops(low_precision=True) == 989e12
    )
    a100 = _from_name("NVIDIA A100-SXM4-40GB", memory=42_000_000_000)
    assert a100 is not None and a100.name == "a100-40gb"
    assert _from_name("Some Future GPU", memory=1) is None
    assert DEVICES["cpu"].peak_flops(low_precision=False) is None
    assert device_from(name="h100", memory="40GiB").memory == 40 * 1024**3  # type: ignore[union-attr]
    assert device_from(name=None, memory=None) is None
