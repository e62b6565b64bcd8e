"""Device meshes: 1-D (shard) or 2-D (replicate x shard) for data parallelism alone,
and the N-D mesh of [Note: parallel dimensions] (fsdpkit.config.dims) with tensor or
context parallelism, with the sub-meshes each layer of parallelism works on.

The mesh is always passed explicitly; fsdpkit keeps no global mesh. Code that shards
takes the run's whole mesh and asks this module for its part (``fsdp_mesh``,
``tp_mesh``, ``cp_mesh``), so a mesh without tp or cp axes works unchanged. Which
batches a rank reads is ``ParallelDims.dp_rank`` (fsdpkit.config.dims).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache

from fsdpkit.config.dims import MeshAxis, ParallelDims
from fsdpkit.devices import device_type as local_device_type
from fsdpkit.errors import UserError


class MeshError(UserError, ValueError):
    """The requested mesh does not fit the world size."""


def build_mesh(dims: ParallelDims | None = None, *, device_type: str | None = None) -> DeviceMesh:
    """The mesh of ``dims`` over all ranks (None: FSDP over all of them, a 1-D
    ``("shard",)`` mesh).

    The axes of [Note: parallel dimensions], in ``MeshAxis`` order: "pp" where > 1 (the
    rest then describes each stage's world / pp ranks), "replicate" where > 1 (HSDP;
    ``shard == 1`` is DDP-like replication), "shard" always, "cp", "ep" and "tp" where
    > 1. ``ep`` > 1 splits the shard axis into "efsdp" x "ep" ("shard" is then their
    flattening); with cp the flattened axes FSDP2 shards over are added too
    (``fsdp_mesh``, ``expert_fsdp_mesh``). ``dims`` validated its own degrees; the one
    check here is that they make the process group's size, which must be initialized.
    DTensor's caches are dropped first ([Note: equal meshes]).
    """
    forget_meshes()
    world = dist.get_world_size()
    dims = dims if dims is not None else ParallelDims(replicate=1, shard=world)
    if dims.world != world:
        raise MeshError(
            f"the parallel dimensions {dims.describe()} make {dims.world} ranks, but the "
            f"process group has {world}. Choose degrees whose product is {world} "
            "(parallel.pp x tp x cp, with parallel.shard_degree for hybrid strategies)."
        )
    axes = _axes(dims)
    mesh = init_device_mesh(
        device_type or local_device_type(),
        tuple(axes.values()),
        mesh_dim_names=tuple(a.value for a in axes),  # plain strings in torch's objects
    )
    _flatten_data_axes(mesh, dims)
    return mesh


def _axes(dims: ParallelDims) -> dict[MeshAxis, int]:
    """The mesh's axes and sizes, slowest first: the shard (or efsdp) axis always, every
    other one where it is > 1."""
    data = (
        [(MeshAxis.SHARD, dims.shard)]
        if dims.ep == 1
        else [(MeshAxis.EFSDP, dims.shard // dims.ep)]
    )
    named = [
        (MeshAxis.PP, dims.pp),
        (MeshAxis.REPLICATE, dims.replicate),
        *data,
        (MeshAxis.CP, dims.cp),
        (MeshAxis.EP, dims.ep),
        (MeshAxis.TP, dims.tp),
    ]
    return {n: d for n, d in named if d > 1 or n in (MeshAxis.SHARD, MeshAxis.EFSDP)}


def _flatten_data_axes(mesh: DeviceMesh, dims: ParallelDims) -> None:
    """The flattened axes FSDP2 shards over ([Note: parallel dimensions])."""
    if dims.ep > 1:  # the data axes as without ep, and the experts' FSDP axis
        mesh[MeshAxis.EFSDP, MeshAxis.EP]._flatten(MeshAxis.SHARD.value)
    if dims.cp > 1:  # FSDP shards over shard x cp
        mesh[
            (MeshAxis.EFSDP, MeshAxis.CP, MeshAxis.EP)
            if dims.ep > 1
            else (MeshAxis.SHARD, MeshAxis.CP)
        ]._flatten(MeshAxis.SHARD_CP.value)
        if dims.ep > 1:
            mesh[MeshAxis.EFSDP, MeshAxis.CP]._flatten(MeshAxis.EFSDP_CP.value)


def forget_meshes() -> None:
    """Drop DTensor's caches of sharding decisions, which hold meshes.

    [Note: equal meshes]
    DTensor caches an op's output placements (in Python and in C++) by its inputs'
    specs, and meshes compare equal by shape, ranks and axis names alone, not by their
    process groups. So the second of two equal meshes in one process was handed the
    first one's outputs, with the first mesh's groups: two ring-attention
    configurations measured one after the other in one spawn (bench/plan_accuracy.py's
    "MP A dp2 x cp2 ring" rows) deadlocked in the second one's ring backward, waiting
    on a key / value all-gather; a trace after an earlier one (each starts and destroys
    its own fake process group) was handed the earlier, destroyed groups ("Could not
    resolve the process group registered under the name 3"). ``build_mesh`` drops
    them before every mesh it builds; the planner's trace also after each trace.
    """
    torch._C._clear_DTensor_sharding_propagator_cache()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    clear_redistribute_planner_cache()


def _names(mesh: DeviceMesh) -> tuple[str, ...]:
    return tuple(mesh.mesh_dim_names or ())


def _axis(mesh: DeviceMesh, axis: MeshAxis) -> DeviceMesh | None:
    """The 1-D mesh of ``axis``, or None where the mesh has no such axis."""
    return mesh[axis] if axis in _names(mesh) else None


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: the whole mesh without tp/cp/pp/ep axes, else its
    data axes with cp folded into the shard axis (one stage's, under pp)."""
    names = _names(mesh)
    if not {MeshAxis.TP, MeshAxis.CP, MeshAxis.PP, MeshAxis.EP} & set(names):
        return mesh
    return _data_mesh(mesh, MeshAxis.SHARD_CP if MeshAxis.CP in names else MeshAxis.SHARD)


def _data_mesh(mesh: DeviceMesh, shard: MeshAxis) -> DeviceMesh:
    """The replicate axis (where there is one) and the (flattened) axis ``shard``."""
    with warnings.catch_warnings():
        # torch 2.13 slices a flattened axis from the root mesh as asked, and announces
        # a future deprecation of doing so on every call
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return (
            mesh[MeshAxis.REPLICATE, shard] if MeshAxis.REPLICATE in _names(mesh) else mesh[shard]
        )


def ep_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The expert-parallel axis, or None."""
    return _axis(mesh, MeshAxis.EP)


def expert_fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards the routed experts over under expert parallelism: the data
    axes without ep (cp folded in), [Note: parallel dimensions]."""
    return _data_mesh(mesh, MeshAxis.EFSDP_CP if MeshAxis.CP in _names(mesh) else MeshAxis.EFSDP)


def experts_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The axes the routed experts' weights are laid out on before FSDP2: ep (split by
    expert) and tp (replicated, each tp rank computing its own tokens: [Note: experts
    under tensor parallelism] in fsdpkit.sharding.tensor.moe), those the mesh has; None
    without either."""
    axes = tuple(a.value for a in (MeshAxis.EP, MeshAxis.TP) if a in _names(mesh))
    return mesh[axes] if axes else None


def tp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The tensor-parallel axis, or None."""
    return _axis(mesh, MeshAxis.TP)


def cp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The context-parallel axis, or None."""
    return _axis(mesh, MeshAxis.CP)


def stage_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """Every rank of this rank's pipeline stage (the mesh's axes but pp, flattened):
    the ranks that hold different tokens of the same layers."""
    names = tuple(n for n in _names(mesh) if n != MeshAxis.PP)
    if len(names) == 1:
        return mesh[names[0]].get_group()
    return mesh[names]._flatten(MeshAxis.STAGE.value).get_group()


def pp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The pipeline axis (this rank's pipeline group), or None."""
    return _axis(mesh, MeshAxis.PP)
