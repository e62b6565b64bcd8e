"""The run's parallel dimensions and the layouts a model can take, without a process
group: [Note: parallel dimensions] (fsdpkit.config.dims) and the refusals of
fsdpkit.sharding.tensor.plans / context, each naming the field."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from torch import nn

from fsdpkit.config import ConfigError, ParallelDims, load, parallel_dims
from fsdpkit.config.dims import MeshAxis
from fsdpkit.sharding.tensor.rules import TensorParallelError, check_layout, check_model
from support import TINY, build


def _dims(*overrides: str, world: int = 8, local: int = 8):  # type: ignore[no-untyped-def]
    return parallel_dims(load(None, list(overrides)), world_size=world, local_world_size=local)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ((), (1, 8, 1, 1)),
        (("parallel.tp=2",), (1, 4, 1, 2)),
        (("parallel.cp=2", "parallel.tp=2"), (1, 2, 2, 2)),
        (("parallel.strategy=hybrid", "parallel.tp=2"), (1, 4, 1, 2)),
        (("parallel.strategy=hybrid", "parallel.shard_degree=2", "parallel.tp=2"), (2, 2, 1, 2)),
        (("parallel.strategy=replicate", "parallel.cp=4"), (2, 1, 4, 1)),
    ],
)
def test_dims_multiply_to_the_world(overrides: tuple[str, ...], expected: tuple[int, ...]) -> None:
    dims = _dims(*overrides)
    assert (dims.replicate, dims.shard, dims.cp, dims.tp) == expected
    assert dims.world == 8
    assert dims.fsdp_shard == dims.shard * dims.cp


@pytest.mark.parametrize(
    "degrees",
    [dict(shard=0), dict(shard=2, tp=0), dict(shard=2, cp=-1), dict(shard=2, pp=0),
     dict(shard=3, ep=2), dict(shard=2, ep=0)],
)  # fmt: skip
def test_dims_refuse_degrees_that_make_no_mesh(degrees: dict[str, int]) -> None:
    """ParallelDims checks its own degrees, so build_mesh needs no check of its own."""
    with pytest.raises(ConfigError, match=r"must be >= 1 and ep must divide shard"):
        ParallelDims(replicate=1, **degrees)


def test_dims_name_their_axes_by_the_mesh_axis_enum() -> None:
    dims = ParallelDims(replicate=2, shard=4, cp=2, tp=2, pp=2, ep=2)
    assert [name for name, _ in dims.named()] == ["pp", "replicate", "shard", "cp", "tp", "ep"]
    assert all(isinstance(name, MeshAxis) for name, _ in dims.named())
    assert dims.describe() == "pp 2 x replicate 2 x shard 4 x cp 2 x tp 2 (ep 2 of the shard axis)"
    assert (dims.fsdp_shard, dims.efsdp, dims.world) == (8, 4, 64)


def test_ranks_of_one_tp_and_cp_group_read_the_same_batches() -> None:
    dims = _dims("parallel.cp=2", "parallel.tp=2")
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert dims.dp == 2


@pytest.mark.parametrize(
    ("overrides", "world", "local", "says"),
    [
        (("parallel.tp=3",), 8, 8, "parallel.tp x parallel.cp = 3 x 1 = 3 does not divide"),
        (("parallel.tp=4",), 8, 2, "parallel.tp = 4 must divide the ranks per node (2)"),
        (("parallel.cp=2", "data.seq_len=129"), 8, 8, "must divide data.seq_len = 129"),
        (("parallel.tp=0",), 8, 8, "parallel.tp"),
    ],
)
def test_bad_layouts_name_the_field(
    overrides: tuple[str, ...], world: int, local: int, says: str
) -> None:
    with pytest.raises(ConfigError, match=None) as err:
        _dims(*overrides, world=world, local=local)
    assert says in str(err.value)


def test_heads_must_split_over_tp_and_cp() -> None:
    check_layout(load(None, ["model.n_heads=8", "model.n_kv_heads=4", "parallel.tp=4"]))
    with pytest.raises(TensorParallelError, match="does not divide the model's 4 key/value"):
        check_layout(load(None, ["model.n_heads=8", "model.n_kv_heads=4", "parallel.tp=8"]))
    with pytest.raises(ConfigError, match=r"parallel\.cp = 4"):
        check_layout(load(None, ["model.n_heads=8", "parallel.tp=4", "parallel.cp=4"]))


def test_a_model_without_a_plan_is_refused_by_name() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

    with pytest.raises(TensorParallelError, match="no tensor-parallel plan for Net"):
        check_model(Net(), tp=2)
    check_model(build(TINY), tp=2)  # the built-in Llama has one


def test_hf_directories_are_checked_from_their_config(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tiny_hf import write_tiny_model

    os.environ["HF_HUB_OFFLINE"] = "1"
    llama = write_tiny_model(tmp_path / "llama", arch="llama", weights=False, tokenizer=False)
    gpt2 = write_tiny_model(tmp_path / "gpt2", arch="gpt2", weights=False, tokenizer=False)
    check_layout(load(None, [f"model.hf={llama}", "parallel.tp=2"]))
    with pytest.raises(TensorParallelError, match="key/value heads"):
        check_layout(load(None, [f"model.hf={llama}", "parallel.tp=4"]))
    with pytest.raises(TensorParallelError, match="no tensor-parallel plan for GPT2Config"):
        check_layout(load(None, [f"model.hf={gpt2}", "parallel.tp=2"]))
