"""Device meshes (fsdpkit.sharding.mesh): the axes ``build_mesh`` makes of a
``ParallelDims`` and the parts each layer asks for, on torch's "fake" process group of
16 ranks (one process, as the planner's trace builds them); and two equal meshes in
one process keep their own process groups ([Note: equal meshes]).

For the latter one gloo rank in this process (an in-memory store): enough for DTensor's
sharding caches, which are per process. The bug was seen on 4 ranks as a deadlock: two
ring attention configurations measured one after the other in one spawn.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdpkit.config import ParallelDims
from fsdpkit.sharding.mesh import (
    MeshError,
    build_mesh,
    cp_mesh,
    ep_mesh,
    expert_fsdp_mesh,
    fsdp_mesh,
    pp_mesh,
    tp_mesh,
)


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _outputs_meshes() -> tuple[object, ...]:
    """A fresh mesh, and the meshes of two DTensor ops' outputs on it."""
    mesh = build_mesh(device_type="cpu")
    x = DTensor.from_local(torch.ones(4, 4), mesh, [Shard(0)])
    return mesh, (x * 2).device_mesh, (x @ x.T).redistribute(mesh, [Replicate()]).device_mesh


@pytest.mark.usefixtures("one_rank")
def test_a_second_equal_mesh_gets_outputs_on_itself_not_on_the_first() -> None:
    first, *_ = _outputs_meshes()
    second, elementwise, redistributed = _outputs_meshes()
    assert second == first  # equal by shape, ranks and names: what DTensor's caches key on
    # before build_mesh dropped the caches, the elementwise op's output was on ``first``
    assert elementwise is second and redistributed is second


@pytest.fixture
def fake_world() -> Iterator[int]:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=16)
    try:
        yield 16
    finally:
        dist.destroy_process_group()


def _shape(mesh: DeviceMesh | None) -> dict[str, int] | None:
    if mesh is None:
        return None
    return dict(zip(mesh.mesh_dim_names or (), mesh.mesh.shape, strict=True))


@pytest.mark.usefixtures("fake_world")
def test_no_dims_is_fsdp_over_every_rank() -> None:
    mesh = build_mesh(device_type="cpu")
    assert _shape(mesh) == {"shard": 16} and fsdp_mesh(mesh) is mesh
    assert tp_mesh(mesh) is cp_mesh(mesh) is ep_mesh(mesh) is pp_mesh(mesh) is None


@pytest.mark.parametrize(
    ("dims", "axes", "fsdp", "experts"),
    [
        (ParallelDims(replicate=2, shard=8), {"replicate": 2, "shard": 8}, None, None),
        (
            ParallelDims(replicate=1, shard=2, cp=2, tp=2, pp=2),
            {"pp": 2, "shard": 2, "cp": 2, "tp": 2},
            {"shard_cp": 4},
            None,
        ),
        (
            ParallelDims(replicate=2, shard=4, cp=2, ep=2),
            {"replicate": 2, "efsdp": 2, "cp": 2, "ep": 2},
            {"replicate": 2, "shard_cp": 8},
            {"replicate": 2, "efsdp_cp": 4},
        ),
        (
            ParallelDims(replicate=1, shard=8, ep=4, tp=2),
            {"efsdp": 2, "ep": 4, "tp": 2},
            {"shard": 8},
            {"efsdp": 2},
        ),
    ],
)
@pytest.mark.usefixtures("fake_world")
def test_the_mesh_has_the_axes_of_its_dims(
    dims: ParallelDims,
    axes: dict[str, int],
    fsdp: dict[str, int] | None,
    experts: dict[str, int] | None,
) -> None:
    """[Note: parallel dimensions]: pp slowest, tp fastest, ep split off the shard axis;
    FSDP shards over shard x cp, the routed experts over efsdp x cp."""
    mesh = build_mesh(dims, device_type="cpu")
    assert _shape(mesh) == axes
    assert _shape(fsdp_mesh(mesh)) == (fsdp or axes)
    assert all(type(n) is str for n in mesh.mesh_dim_names or ())  # no enum in torch's objects
    if experts is not None:
        assert _shape(expert_fsdp_mesh(mesh)) == experts
        assert _shape(ep_mesh(mesh)) == {"ep": dims.ep}
    for part, degree, name in ((tp_mesh, dims.tp, "tp"), (cp_mesh, dims.cp, "cp"),
                               (pp_mesh, dims.pp, "pp")):  # fmt: skip
        assert _shape(part(mesh)) == ({name: degree} if degree > 1 else None)


@pytest.mark.usefixtures("fake_world")
def test_dims_of_another_world_size_are_refused_naming_both() -> None:
    with pytest.raises(MeshError, match=r"tp 2 make 8 ranks, but the process group has 16"):
        build_mesh(ParallelDims(replicate=1, shard=4, tp=2), device_type="cpu")
