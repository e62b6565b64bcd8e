"""The parallel dimensions of a run: how its ranks split into pipeline stages,
replicas, shard groups, context-parallel and tensor-parallel groups, decided once from
the config and the world size.

[Note: parallel dimensions]
A run's ranks form one mesh of shape (pp, replicate, shard, cp, tp), tp fastest (so a
tensor-parallel group is consecutive ranks, inside one node) and pp slowest (so the
pipeline stages are the axis that crosses nodes: only activations pass between them):

- ``pp`` ranks hold consecutive stages of the model's blocks and see the same batches
  (fsdpkit.sharding.pipeline); everything below is repeated inside each stage;
- ``tp`` ranks split every block's matmuls and see the same batch;
- ``cp`` ranks split every sequence of the same batch;
- ``replicate x shard`` are the data-parallel ranks: each reads its own batches
  (``batch_split`` runs at ``dp`` ranks), and the strategy's mesh shape
  (fsdpkit.strategies) is taken over them.

FSDP2 shards parameters over ``shard x cp`` (cp folded into the shard axis, as
torchtitan does: context-parallel ranks hold the same parameters, so they may as
well hold different shards of them) and replicates over ``replicate``.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdpkit.config.schema import RunConfig
from fsdpkit.errors import ConfigError
from fsdpkit.strategies import strategy


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of [Note: parallel dimensions]; their product is the world size."""

    replicate: int
    shard: int
    cp: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel ranks: how many different batches a micro-step reads."""
        return self.replicate * self.shard

    @property
    def world(self) -> int:
        return self.pp * self.stage_world

    @property
    def stage_world(self) -> int:
        """Ranks of one pipeline stage (the whole world without pp)."""
        return self.dp * self.cp * self.tp

    @property
    def fsdp_shard(self) -> int:
        """Ranks one FSDP shard group spans (the shard axis with cp folded in)."""
        return self.shard * self.cp

    @property
    def model_parallel(self) -> bool:
        """Whether a tp or cp axis exists (an N-D mesh rather than FSDP's own)."""
        return self.tp > 1 or self.cp > 1

    def dp_rank(self, rank: int) -> int:
        """The data-parallel index of global ``rank`` (which batches it reads): ranks
        that differ only in their pp, cp or tp coordinate read the same ones."""
        return (rank % self.stage_world) // (self.cp * self.tp)

    def pp_rank(self, rank: int) -> int:
        """The pipeline coordinate of global ``rank`` (which stages it holds)."""
        return rank // self.stage_world

    def describe(self) -> str:
        parts = [f"{n} {d}" for n, d in self.named() if d > 1 or n == "shard"]
        return " x ".join(parts)

    def named(self) -> list[tuple[str, int]]:
        return [
            ("pp", self.pp),
            ("replicate", self.replicate),
            ("shard", self.shard),
            ("cp", self.cp),
            ("tp", self.tp),
        ]


def parallel_dims(cfg: RunConfig, *, world_size: int, local_world_size: int) -> ParallelDims:
    """The run's dimensions at ``world_size`` ranks (``local_world_size`` per node);
    a ConfigError naming the field when they cannot be formed."""
    p = cfg.parallel
    if p.tp < 1 or p.cp < 1 or p.pp < 1:
        raise ConfigError(
            f"parallel.tp, parallel.cp and parallel.pp must be >= 1, got tp={p.tp}, "
            f"cp={p.cp}, pp={p.pp}."
        )
    if p.pp > 1 and world_size % (p.pp * p.tp * p.cp):
        raise ConfigError(
            f"parallel.pp x parallel.tp x parallel.cp = {p.pp} x {p.tp} x {p.cp} does not "
            f"divide the world size {world_size}: each of the pp pipeline stages gets world "
            "/ pp ranks, split again by tp and cp. Choose degrees whose product divides "
            f"{world_size}."
        )
    world_size //= p.pp  # the rest describes one stage's ranks
    model_ranks = p.tp * p.cp
    if world_size % model_ranks:
        raise ConfigError(
            f"parallel.tp x parallel.cp = {p.tp} x {p.cp} = {model_ranks} does not divide the "
            f"world size {world_size}: the data-parallel ranks are world / (tp x cp). Choose "
            f"degrees whose product divides {world_size}."
        )
    if p.tp > 1 and (p.tp > local_world_size or local_world_size % p.tp):
        raise ConfigError(
            f"parallel.tp = {p.tp} must divide the ranks per node ({local_world_size}): a "
            "tensor-parallel group exchanges activations in every block, several times a "
            "step, and only a node's own links are fast enough. Use a tp that divides "
            f"{local_world_size} and scale across nodes with data (or context) parallelism."
        )
    if cfg.data.seq_len % model_ranks:
        raise ConfigError(
            f"parallel.cp x parallel.tp = {p.cp} x {p.tp} must divide data.seq_len = "
            f"{cfg.data.seq_len}: each context-parallel rank holds an equal slice of every "
            "sequence, and sequence parallelism splits that slice over the tp ranks. Pick "
            f"a seq_len that is a multiple of {model_ranks}."
        )
    dp = world_size // model_ranks
    local_dp = max(min(local_world_size, world_size) // model_ranks, 1)
    replicate, shard = strategy(p.strategy).mesh_shape(
        world_size=dp, shard_degree=p.shard_degree or local_dp
    )
    return ParallelDims(replicate=replicate, shard=shard, cp=p.cp, tp=p.tp, pp=p.pp)
