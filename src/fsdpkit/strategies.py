"""The data-parallel strategies: one frozen record each, the only place they are defined.

Config validation, ``build_mesh`` callers, ``shard()``, the planner and the recommender
read these records; a strategy's name is spelled here (and in the config's ``Literal``,
which a unit test keeps equal to ``STRATEGIES``).

    full            ZeRO-3: params, grads, optimizer state sharded; reshard after forward
    grad_op         ZeRO-2: as full, but parameters stay unsharded from forward to backward
    hybrid          HSDP: full shard inside a group of ``shard_degree`` ranks, replicas across
    hybrid_grad_op  HSDP with grad_op inside the shard group
    replicate       DDP-like: FSDP2 on a (world x 1) mesh, full copies, all-reduced grads
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdpkit.errors import ConfigError


@dataclass(frozen=True)
class Strategy:
    """What one ``parallel.strategy`` value means for the mesh, resharding and traffic."""

    name: str
    reshards_after_forward: bool
    """Default ``reshard_after_forward`` of its block units (ZeRO-3 yes, ZeRO-2 no)."""
    hybrid: bool
    """2-D (replicate x shard) mesh with ``parallel.shard_degree`` ranks per shard group."""
    replicates: bool
    """Shard group of one rank: every rank holds full parameters (DDP-like)."""

    @property
    def allows_offload(self) -> bool:
        """CPU offload keeps parameters sharded between uses, so the strategy must
        reshard after forward."""
        return self.reshards_after_forward

    @property
    def collectives(self) -> tuple[str, ...]:
        """Collectives a step issues: all-gather / reduce-scatter inside the shard group,
        all-reduce across replicas."""
        if self.replicates:
            return ("all_reduce",)
        return ("all_gather", "reduce_scatter", *(("all_reduce",) if self.hybrid else ()))

    def mesh_shape(self, *, world_size: int, shard_degree: int | None) -> tuple[int, int]:
        """(replicate degree, shard degree) at ``world_size``; ``shard_degree`` is used
        by hybrid strategies only (the caller defaults it to the ranks per node)."""
        if self.replicates:
            return world_size, 1
        if not self.hybrid:
            return 1, world_size
        shard = shard_degree or world_size
        if shard < 1 or world_size % shard:
            raise ConfigError(
                f"parallel.shard_degree = {shard} does not divide the world size {world_size}: "
                "the mesh is (replicas x shard_degree) and must multiply to the world size. "
                f"Pick a divisor of {world_size}."
            )
        return world_size // shard, shard


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("full", reshards_after_forward=True, hybrid=False, replicates=False),
        Strategy("grad_op", reshards_after_forward=False, hybrid=False, replicates=False),
        Strategy("hybrid", reshards_after_forward=True, hybrid=True, replicates=False),
        Strategy("hybrid_grad_op", reshards_after_forward=False, hybrid=True, replicates=False),
        Strategy("replicate", reshards_after_forward=False, hybrid=False, replicates=True),
    )
}


def strategy(name: str) -> Strategy:
    """The record of ``name`` (config validation has already checked it exists)."""
    return STRATEGIES[name]
