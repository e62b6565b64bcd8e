"""Config: TOML + overrides, types, did-you-mean, cross-field checks, round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdpkit import config as c
from fsdpkit.config import ConfigError


def test_defaults_are_valid_and_documented() -> None:
    cfg = c.load()
    assert cfg.model.preset == "tiny" and cfg.parallel.strategy == "full"
    text = c.describe()
    for key in (
        "model.preset",
        "model.factory",
        "data.path",
        "train.steps",
        "train.seed",
        "parallel.strategy",
        "checkpoint.every",
        "logging.run_dir",
    ):
        assert key in text
    for cls in c.SECTIONS.values():
        docs = c.field_docs(cls)
        missing = [f for f in cls.__dataclass_fields__ if not docs.get(f)]
        assert not missing, (cls.__name__, missing)


def test_overrides_are_typed() -> None:
    cfg = c.load(
        None,
        [
            "train.steps=50",
            "train.lr=1e-3",
            "parallel.strategy=hybrid",
            "parallel.block_classes=Block,Other",
            "parallel.reshard_after_forward=2",
            "data.path=some/file.txt",
        ],
    )
    assert cfg.train.steps == 50 and cfg.train.lr == 1e-3
    assert cfg.parallel.block_classes == ["Block", "Other"]
    assert cfg.parallel.reshard_after_forward == 2
    assert cfg.data.path == "some/file.txt"
    assert c.load(None, ["train.lr=1"]).train.lr == 1.0  # int widened to float


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["train.stpes=3"], "Did you mean 'steps'"),
        (["trian.steps=3"], "Did you mean 'train'"),
        (["train.steps=abc"], "train.steps"),
        (["train.steps=true"], "wrong type"),
        (["parallel.strategy=ful"], "Did you mean 'full'"),
        (["train.steps=0"], "train.steps must be > 0"),
        (["data.val_fraction=0.7"], "data.val_fraction"),
        (["offload.params=true", "parallel.strategy=replicate"], "offload.params"),
        (["precision.mode=fp16", "precision.grad_scaler=false"], "grad_scaler"),
        (["model.factory=nocolon"], "package.module:function"),
        (["parallel.shard_degree=2"], "only used by hybrid"),
        (["steps=3"], "section.field"),
        (["train.steps"], "key=value"),
        (["train.min_lr_ratio=-1"], "train.min_lr_ratio"),
        (["train.lr=nan"], "finite"),
        (["parallel.timeout_s=inf"], "finite"),
        (["train.beta2=1.5"], "train.beta2"),
        (["train.weight_decay=-0.1"], "train.weight_decay"),
    ],
)
def test_bad_values_name_the_key(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        c.load(None, overrides)


def test_world_size_checks() -> None:
    cfg = c.load(None, ["parallel.strategy=hybrid", "parallel.shard_degree=3"])
    with pytest.raises(ConfigError, match="does not divide the world size 4"):
        c.validate_for_world(cfg, world_size=4, local_world_size=4)
    cfg = c.load(None, ["parallel.reshard_after_forward=3"])
    with pytest.raises(ConfigError, match="must divide the shard group size"):
        c.validate_for_world(cfg, world_size=4, local_world_size=4)
    assert c.mesh_shape(
        c.load(None, ["parallel.strategy=hybrid"]), world_size=8, local_world_size=4
    ) == (2, 4)
    assert c.mesh_shape(
        c.load(None, ["parallel.strategy=replicate"]), world_size=4, local_world_size=4
    ) == (4, 1)


def test_toml_file_and_resolved_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[train]\nsteps = 7\n[parallel]\nstrategy = "grad_op"\n')
    cfg = c.load(path, ["train.seed=3"])
    assert (cfg.train.steps, cfg.train.seed, cfg.parallel.strategy) == (7, 3, "grad_op")
    resolved = tmp_path / "resolved.toml"
    resolved.write_text(c.to_toml(cfg))
    assert c.load(resolved) == cfg


def test_bad_toml_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        c.load(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        c.load(bad)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[trainer]\nsteps = 3\n")
    with pytest.raises(ConfigError, match=r"unknown section \[trainer\].*'train'"):
        c.load(unknown)
