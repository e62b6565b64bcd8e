"""Device meshes (fsdpkit.sharding.mesh): two equal meshes in one process keep their
own process groups ([Note: equal meshes]).

One gloo rank in this process (an in-memory store): enough for DTensor's sharding
caches, which are per process. The bug was seen on 4 ranks as a deadlock: two ring
attention configurations measured one after the other in one spawn.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdpkit.sharding.mesh import build_mesh


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _outputs_meshes() -> tuple[object, ...]:
    """A fresh mesh, and the meshes of two DTensor ops' outputs on it."""
    mesh = build_mesh(shard=1, device_type="cpu")
    x = DTensor.from_local(torch.ones(4, 4), mesh, [Shard(0)])
    return mesh, (x * 2).device_mesh, (x @ x.T).redistribute(mesh, [Replicate()]).device_mesh


@pytest.mark.usefixtures("one_rank")
def test_a_second_equal_mesh_gets_outputs_on_itself_not_on_the_first() -> None:
    first, *_ = _outputs_meshes()
    second, elementwise, redistributed = _outputs_meshes()
    assert second == first  # equal by shape, ranks and names: what DTensor's caches key on
    # before build_mesh dropped the caches, the elementwise op's output was on ``first``
    assert elementwise is second and redistributed is second
