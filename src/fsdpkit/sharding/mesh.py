"""Device meshes for data parallelism: 1-D (shard) or 2-D (replicate x shard).

The mesh is always passed explicitly; fsdpkit keeps no global mesh.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdpkit.devices import device_type as local_device_type
from fsdpkit.errors import UserError


class MeshError(UserError, ValueError):
    """The requested mesh does not fit the world size."""


def build_mesh(
    *,
    shard: int | None = None,
    replicate: int = 1,
    device_type: str | None = None,
    world_size: int | None = None,
) -> DeviceMesh:
    """A data-parallel mesh over all ranks.

    ``replicate == 1`` gives a 1-D mesh named ``("shard",)`` (FSDP / ZeRO); otherwise a
    2-D mesh ``("replicate", "shard")`` (HSDP; ``shard == 1`` is DDP-like replication).
    ``shard`` defaults to world_size / replicate. The process group must be initialized.
    """
    world = world_size if world_size is not None else dist.get_world_size()
    if replicate < 1 or (shard is not None and shard < 1):
        raise MeshError(f"mesh degrees must be >= 1, got replicate={replicate}, shard={shard}")
    if shard is None:
        if world % replicate:
            raise MeshError(
                f"replicate degree {replicate} does not divide the world size {world}; "
                f"choose a divisor of {world}."
            )
        shard = world // replicate
    if replicate * shard != world:
        raise MeshError(
            f"mesh replicate={replicate} x shard={shard} = {replicate * shard} ranks, but the "
            f"world size is {world}. Choose degrees whose product is {world} "
            "(parallel.shard_degree for hybrid strategies)."
        )
    dev = device_type or local_device_type()
    if replicate == 1:
        return init_device_mesh(dev, (shard,), mesh_dim_names=("shard",))
    return init_device_mesh(dev, (replicate, shard), mesh_dim_names=("replicate", "shard"))
