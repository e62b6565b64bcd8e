"""Which blocks each pipeline stage holds, and which rank holds each stage: the one
rule the trainer and the planner share (no process group, no torch modules).

[Note: stage split]
A model under ``parallel.pp`` is cut into ``stages = pp x stages_per_rank``
consecutive runs of its blocks ([Note: block detection] in fsdpkit.sharding.blocks);
the input embedding goes with the first stage, the final norm, the output head and
the loss with the last. ``parallel.pp_split``:

- ``blocks`` (the default): as even as the blocks allow, counting the embedding and
  the head (+ loss) as one block each: the compute of a decoder's blocks is equal, the
  head + loss costs about one block (2 x d x V FLOPs per token, one block's worth for
  d = 4096, V = 128k), and the embedding stands for one so the first stage is not the
  fullest. When the stages divide the blocks this is the same number of blocks per
  stage (that split is already the most even: its largest stage, a block count plus
  one end, is the lower bound); otherwise the stages differ by a block, fewer on the
  ends: Llama 3 405B's 126 blocks over 8 stages are 15 + embedding, 6 x 16, 15 + head
  (torchtitan's layout);
- ``params``: contiguous stages, each at least one block, minimizing the parameters of
  the largest stage, the embedding counted on the first and the head on the last
  (what bounds one stage's weights, gradients and optimizer state).

Stage ``s`` runs on pipeline rank ``stage_rank(s)`` ([Note: pipeline schedules] in
fsdpkit.config.schedules). The run's first lines print the split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fsdpkit.config.schedules import SCHEDULES, stage_rank, stages_per_rank
from fsdpkit.config.schema import RunConfig
from fsdpkit.errors import ConfigError
from fsdpkit.models.hf.directory import read_hf_dir
from fsdpkit.models.llama import preset


@dataclass(frozen=True)
class StageSplit:
    """The blocks of every stage and the rank of every stage ([Note: stage split])."""

    blocks: tuple[tuple[int, ...], ...]
    """Block indices (forward order) of each stage."""
    ranks: tuple[int, ...]
    """The pipeline rank holding each stage."""
    params: tuple[int, ...] = ()
    """Parameters of each stage (embedding on the first, head and final norm on the
    last), when the split was computed from a model."""

    @property
    def stages(self) -> int:
        return len(self.blocks)

    def local(self, pp_rank: int) -> list[int]:
        """The stages ``pp_rank`` holds, in stage order."""
        return [s for s, r in enumerate(self.ranks) if r == pp_rank]

    def describe(self) -> str:
        """One line per pipeline rank: its stages and their blocks."""
        lines = []
        for rank in sorted(set(self.ranks)):
            parts = [self._stage(s) for s in self.local(rank)]
            lines.append(f"pp rank {rank}: " + "; ".join(parts))
        return "\n".join(lines)

    def _stage(self, s: int) -> str:
        first, last = self.blocks[s][0], self.blocks[s][-1]
        what = f"blocks {first}-{last}" if last > first else f"block {first}"
        if s == 0:
            what = "embedding + " + what
        if s == self.stages - 1:
            what += " + norm, head, loss"
        size = f" ({self.params[s] / 1e6:.2f}M params)" if self.params else ""
        return f"stage {s}: {what}{size}"


def equal_blocks(n_blocks: int, stages: int) -> tuple[tuple[int, ...], ...]:
    """``stages`` runs of ``n_blocks / stages`` blocks (``stages`` divides ``n_blocks``)."""
    per = n_blocks // stages
    return tuple(tuple(range(s * per, (s + 1) * per)) for s in range(stages))


ENDS_IN_BLOCKS = (1, 1)
"""What the embedding and the head + loss count for in ``pp_split = blocks`` ([Note:
stage split]): one block each."""


def balanced_blocks(
    weights: Sequence[int], stages: int, *, first: int = 0, last: int = 0
) -> tuple[tuple[int, ...], ...]:
    """Contiguous runs of at least one block minimizing the largest run's weight, then
    the sum of the runs' squared weights (the most even of the optimal splits), with
    ``first`` added to the first run and ``last`` to the last (dynamic programming over
    cut points)."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    worst = (float("inf"), float("inf"))
    # best[k][i]: (largest run, sum of squares) of blocks[:i] in k runs; cut: where the kth starts
    best = [[worst] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0, 0)
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                run = prefix[i] - prefix[j] + (first if j == 0 else 0)
                run += last if i == n else 0
                high, squares = best[k - 1][j]
                cost = (max(high, run), squares + run * run)
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [], n
    for k in range(stages, 0, -1):
        bounds.append((cut[k][i], i))
        i = cut[k][i]
    return tuple(tuple(range(a, b)) for a, b in reversed(bounds))


def split_stages(
    *,
    block_params: Sequence[int],
    stages: int,
    mode: str,
    edge_params: tuple[int, int] = (0, 0),
) -> tuple[tuple[int, ...], ...]:
    """The blocks of each of ``stages`` stages ([Note: stage split]): ``block_params``
    per block, ``edge_params`` = (embedding, final norm + head) parameters."""
    n = len(block_params)
    if n < stages:
        raise ConfigError(
            f"the model has {n} blocks, fewer than its {stages} pipeline stages "
            "(parallel.pp x stages per rank): every stage needs at least one block. Use "
            "a smaller parallel.pp or parallel.pp_stages_per_rank."
        )
    if mode == "blocks":
        if n % stages == 0:
            return equal_blocks(n, stages)
        first, last = ENDS_IN_BLOCKS
        return balanced_blocks([1] * n, stages, first=first, last=last)
    return balanced_blocks(block_params, stages, first=edge_params[0], last=edge_params[1])


def stage_split(
    cfg: RunConfig, *, block_params: Sequence[int], edge_params: tuple[int, int] = (0, 0)
) -> StageSplit:
    """The run's split of blocks with ``block_params`` parameters each."""
    p = cfg.parallel
    spec = SCHEDULES[p.pp_schedule]
    stages = p.pp * stages_per_rank(schedule=p.pp_schedule, configured=p.pp_stages_per_rank)
    blocks = split_stages(
        block_params=block_params, stages=stages, mode=p.pp_split, edge_params=edge_params
    )
    ranks = tuple(stage_rank(s, pp=p.pp, style=spec.style) for s in range(stages))
    params = tuple(sum(block_params[b] for b in run) for run in blocks)
    params = (params[0] + edge_params[0], *params[1:])
    params = (*params[:-1], params[-1] + edge_params[1])
    return StageSplit(blocks=blocks, ranks=ranks, params=params)


def check_pipeline_layout(cfg: RunConfig) -> None:
    """Refuse a pipeline layout the configured model cannot take, from the config alone
    (the launcher calls this before any process starts): fewer blocks than stages. A
    factory model is checked when it is built."""
    p, m = cfg.parallel, cfg.model
    if p.pp == 1 or m.factory:
        return
    if m.hf:
        config = read_hf_dir(m.hf).config
        n_blocks = getattr(config, "num_hidden_layers", None)
    else:
        n_blocks = m.n_layers or preset(m.preset).n_layers
    if isinstance(n_blocks, int):
        stages = p.pp * stages_per_rank(schedule=p.pp_schedule, configured=p.pp_stages_per_rank)
        split_stages(block_params=[1] * n_blocks, stages=stages, mode=p.pp_split)
