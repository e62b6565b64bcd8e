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

from fsdpkit.devices import device_type as local_device_type
from fsdpkit.errors import UserError


class MeshError(UserError, ValueError):
    """The requested mesh does not fit the world size."""


def build_mesh(
    *,
    shard: int | None = None,
    replicate: int = 1,
    cp: int = 1,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    device_type: str | None = None,
    world_size: int | None = None,
) -> DeviceMesh:
    """A data-parallel mesh over all ranks.

    ``replicate == 1`` gives a 1-D mesh named ``("shard",)`` (FSDP / ZeRO); otherwise a
    2-D mesh ``("replicate", "shard")`` (HSDP; ``shard == 1`` is DDP-like replication).
    ``shard`` defaults to world_size / (replicate x cp x tp). With ``cp`` or ``tp`` > 1
    the mesh has the named axes of [Note: parallel dimensions] ("replicate" only when
    > 1, "shard" always, then "cp", "tp" where > 1). The process group must be
    initialized. DTensor's caches are dropped first ([Note: equal meshes]). With ``pp``
    > 1 a "pp" axis comes first and the rest describes each stage's world / pp ranks.
    ``ep`` > 1 splits the shard axis into "efsdp" x "ep" ([Note: parallel dimensions];
    "shard" is then their flattening).
    """
    forget_meshes()
    world = world_size if world_size is not None else dist.get_world_size()
    if min(cp, tp, pp) < 1 or world % (pp * cp * tp):
        raise MeshError(
            f"mesh pp={pp} x cp={cp} x tp={tp} must be >= 1 and divide the world size {world} "
            "(parallel.pp, parallel.cp, parallel.tp)."
        )
    if pp * cp * tp * ep > 1:
        degrees = {"cp": cp, "tp": tp, "pp": pp, "ep": ep}
        return _model_parallel_mesh(
            shard=shard, replicate=replicate, degrees=degrees, world=world, dev=device_type
        )
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


def _model_parallel_mesh(
    *, shard: int | None, replicate: int, degrees: dict[str, int], world: int, dev: str | None
) -> DeviceMesh:
    """The N-D mesh of [Note: parallel dimensions] ("pp" first where > 1; ``degrees``:
    cp, tp, pp, ep)."""
    cp, tp, pp, ep = degrees["cp"], degrees["tp"], degrees["pp"], degrees["ep"]
    dp = world // (pp * cp * tp)
    shard = shard if shard is not None else dp // max(replicate, 1)
    if replicate < 1 or shard < 1 or replicate * shard != dp or shard % ep:
        raise MeshError(
            f"mesh replicate={replicate} x shard={shard} must multiply to the {dp} "
            f"data-parallel ranks (world {world} / (pp {pp} x cp {cp} x tp {tp})), and "
            f"ep={ep} divide shard."
        )
    data = [("shard", shard)] if ep == 1 else [("efsdp", shard // ep)]
    named = [("pp", pp), ("replicate", replicate), *data, ("cp", cp), ("ep", ep), ("tp", tp)]
    kept = [(n, d) for n, d in named if d > 1 or n in ("shard", "efsdp")]
    dev = dev or local_device_type()
    mesh = init_device_mesh(
        dev, tuple(d for _, d in kept), mesh_dim_names=tuple(n for n, _ in kept)
    )
    if ep > 1:  # the data axes as without ep, and the experts' FSDP axis
        mesh["efsdp", "ep"]._flatten("shard")
    if cp > 1:  # FSDP shards over shard x cp ([Note: parallel dimensions])
        mesh[("efsdp", "cp", "ep") if ep > 1 else ("shard", "cp")]._flatten("shard_cp")
        if ep > 1:
            mesh["efsdp", "cp"]._flatten("efsdp_cp")
    return mesh


def _names(mesh: DeviceMesh) -> tuple[str, ...]:
    return tuple(mesh.mesh_dim_names or ())


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: the whole mesh without tp/cp/pp/ep axes, else its
    data axes with cp folded into the shard axis (one stage's, under pp)."""
    names = _names(mesh)
    if not {"tp", "cp", "pp", "ep"} & set(names):
        return mesh
    return _data_mesh(mesh, "shard_cp" if "cp" in names else "shard")


def _data_mesh(mesh: DeviceMesh, shard: str) -> DeviceMesh:
    """The replicate axis (where there is one) and the (flattened) axis ``shard``."""
    with warnings.catch_warnings():
        # torch 2.13 slices a flattened axis from the root mesh as asked, and announces
        # a future deprecation of doing so on every call
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh["replicate", shard] if "replicate" in _names(mesh) else mesh[shard]


def ep_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The expert-parallel axis, or None."""
    return mesh["ep"] if "ep" in _names(mesh) else None


def expert_fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards the routed experts over under expert parallelism: the data
    axes without ep (cp folded in), [Note: parallel dimensions]."""
    return _data_mesh(mesh, "efsdp_cp" if "cp" in _names(mesh) else "efsdp")


def tp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The tensor-parallel axis, or None."""
    return mesh["tp"] if "tp" in _names(mesh) else None


def cp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The context-parallel axis, or None."""
    return mesh["cp"] if "cp" in _names(mesh) else None


def pp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The pipeline axis (this rank's pipeline group), or None."""
    return mesh["pp"] if "pp" in _names(mesh) else None
