"""The parallel dimensions of a run: how its ranks split into pipeline stages,
replicas, shard groups, context-parallel and tensor-parallel groups, decided once from
the config and the world size.

[Note: parallel dimensions]
A run's ranks form one mesh of shape (pp, replicate, shard, cp, tp), tp fastest (so a
tensor-parallel group is consecutive ranks, inside one node) and pp slowest (so the
pipeline stages are the axis that crosses nodes: only activations pass between them):

- ``pp`` ranks hold consecutive stages of the model's blocks and see the same batches
  (fsdpkit.sharding.pipeline.stages); everything below is repeated inside each stage;
- ``tp`` ranks split every block's matmuls and see the same batch;
- ``cp`` ranks split every sequence of the same batch;
- ``replicate x shard`` are the data-parallel ranks: each reads its own batches
  (``batch_split`` runs at ``dp`` ranks), and the strategy's mesh shape
  (fsdpkit.strategies) is taken over them.

FSDP2 shards parameters over ``shard x cp`` (cp folded into the shard axis, as
torchtitan does: context-parallel ranks hold the same parameters, so they may as
well hold different shards of them) and replicates over ``replicate``.

``ep`` (expert parallelism) is borrowed from the shard axis, as torchtitan borrows it
from its data ranks: the shard axis splits into ``efsdp x ep``, each ep group holding
every expert once, split by expert; the routed experts are FSDP-sharded over
``efsdp`` (with cp folded in) and replicated over ``replicate``, every other parameter
as without ep. The mesh is (replicate, efsdp, cp, ep, tp): ep the fastest data axis,
after cp, so that the experts' FSDP axes (efsdp, cp) and ep are in the mesh's order
(DTensor reduces a gradient norm over them as one flattened axis, which a
non-ascending pair (efsdp x cp, ep) cannot be: a dp2 x cp2 x ep2 norm failed so).
ep changes neither which batches a rank reads (``dp_rank``) nor the world size
(fsdpkit.sharding.experts.parallel). With ``tp`` the mesh keeps both axes: the experts
are split over ep and whole on every tp rank, each tp rank routing its own tokens
([Note: experts under tensor parallelism] in fsdpkit.sharding.tensor.moe); with ``pp``
each stage splits its own blocks' experts over its ep axis (fsdpkit.sharding.pipeline
.routing carries the router loss across the stages).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from fsdpkit.config.schema import RunConfig
from fsdpkit.errors import ConfigError
from fsdpkit.strategies import strategy


class MeshAxis(StrEnum):
    """The names of a run's mesh axes ([Note: parallel dimensions]), in mesh order
    (slowest first), then the flattened axes fsdpkit.sharding.mesh adds. One spelling
    for every module that builds a mesh or asks one for an axis."""

    PP = "pp"
    REPLICATE = "replicate"
    SHARD = "shard"
    """FSDP's shard axis; under ep the flattening of efsdp x ep."""
    EFSDP = "efsdp"
    """Under ep: the shard axis without its ep ranks (the routed experts' FSDP axis)."""
    CP = "cp"
    EP = "ep"
    TP = "tp"
    SHARD_CP = "shard_cp"
    """Flattened shard x cp (efsdp x cp x ep under ep): what FSDP2 shards over with cp."""
    EFSDP_CP = "efsdp_cp"
    """Flattened efsdp x cp: what the routed experts are sharded over with cp and ep."""
    STAGE = "stage"
    """Under pp: every axis but pp flattened, the ranks of one pipeline stage (whose
    tokens a mixture-of-experts model's router loss sums)."""


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of [Note: parallel dimensions]; their product is the world size.
    Validated when made: every degree >= 1, and ep divides shard."""

    replicate: int
    shard: int
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    """Expert-parallel ranks, borrowed from ``shard`` (it divides ``shard``)."""

    def __post_init__(self) -> None:
        named = self.named()
        if min(d for _, d in named) < 1 or self.shard % self.ep:
            degrees = ", ".join(f"{n}={d}" for n, d in named)
            raise ConfigError(
                f"parallel dimensions {degrees}: every degree must be >= 1 and ep must divide "
                "shard (expert parallelism borrows its ranks from the shard axis). Choose "
                "parallel.pp, tp, cp and ep >= 1, with an ep that divides the shard group."
            )

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
        that differ only in their pp, cp or tp coordinate read the same ones (with ep, cp
        sits between efsdp and ep in the mesh)."""
        outer = (rank % self.stage_world) // self.tp
        if self.ep == 1:
            return outer // self.cp
        return outer // (self.cp * self.ep) * self.ep + outer % self.ep

    def pp_rank(self, rank: int) -> int:
        """The pipeline coordinate of global ``rank`` (which stages it holds)."""
        return rank // self.stage_world

    @property
    def efsdp(self) -> int:
        """Ranks one FSDP shard group of the routed experts spans (shard / ep, cp folded in)."""
        return self.shard // self.ep * self.cp

    def describe(self) -> str:
        shown = [(n, d) for n, d in self.named() if (d > 1 or n == MeshAxis.SHARD)]
        text = " x ".join(f"{n} {d}" for n, d in shown if n != MeshAxis.EP)
        return f"{text} (ep {self.ep} of the shard axis)" if self.ep > 1 else text

    def named(self) -> list[tuple[MeshAxis, int]]:
        return [
            (MeshAxis.PP, self.pp),
            (MeshAxis.REPLICATE, self.replicate),
            (MeshAxis.SHARD, self.shard),
            (MeshAxis.CP, self.cp),
            (MeshAxis.TP, self.tp),
            (MeshAxis.EP, self.ep),
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
    _check_ep(p.ep, shard=shard, strategy=p.strategy)
    return ParallelDims(replicate=replicate, shard=shard, cp=p.cp, tp=p.tp, pp=p.pp, ep=p.ep)


def _check_ep(ep: int, *, shard: int, strategy: str) -> None:
    """ep splits the shard axis ([Note: parallel dimensions]), of each pipeline stage's
    ranks under pp."""
    if ep < 1:
        raise ConfigError(f"parallel.ep must be >= 1, got {ep}.")
    if ep > 1 and shard % ep:
        raise ConfigError(
            f"parallel.ep = {ep} does not divide the shard group ({shard} ranks with "
            f"parallel.strategy = {strategy}): expert parallelism borrows its ranks from "
            "the data-parallel ranks that shard the model, each group of ep of them "
            "holding every expert once. Choose an ep that divides "
            f"{shard}"
            + (
                " (parallel.shard_degree for hybrid strategies)."
                if shard > 1
                else "; strategy replicate has no shard group: use full, grad_op or hybrid."
            )
        )
