"""How a step's sequences split over ranks and micro-batches: the one rule.

[Note: batch split]
``train.global_batch_size`` = G sequences per optimizer step, all ranks together (the
number the training math depends on). At W data-parallel ranks every rank takes
``G / W`` sequences per step (W must divide G: equal shares keep the loss an exact
mean and every rank in the same collectives), in ``A`` micro-batches of ``m``
sequences, where ``A`` is the fewest micro-batches whose size ``m = G / W / A`` is a
whole number no larger than ``train.micro_batch_size`` (the per-rank cap, set by
memory). So G = 12 with a cap of 4 runs as 2 ranks x 2 micro-batches of 3, 3 ranks x
1 of 4, 4 ranks x 1 of 3: the same 12 sequences per step at any world size, and a run
resumed at another world size continues the same loss curve.

When ``train.global_batch_size`` is unset, the older per-rank rule applies:
``train.micro_batch_size`` x ``train.grad_accum`` sequences per rank, so the global
batch grows with the world size (and changes when a run is resumed at another one).

The training session, the planner's scenario and the recommender all call
``batch_split``; nothing else derives these numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdpkit.config.schema import TrainConfig
from fsdpkit.errors import ConfigError


@dataclass(frozen=True)
class BatchSplit:
    """One optimizer step's sequences at a given world size."""

    global_batch: int
    """Sequences per optimizer step, all ranks together."""
    micro_batch: int
    """Sequences per rank in one micro-batch (one forward/backward)."""
    grad_accum: int
    """Micro-batches per rank per optimizer step."""

    @property
    def per_rank(self) -> int:
        """Sequences one rank takes per optimizer step."""
        return self.micro_batch * self.grad_accum


def divisors(n: int) -> list[int]:
    """Every positive divisor of ``n``, ascending (batch splits, mesh degrees)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _indivisible(global_batch: int, dp_world: int) -> ConfigError:
    fits = ", ".join(str(d) for d in divisors(global_batch) if d <= 64)
    near = ", ".join(str(dp_world * k) for k in range(max(global_batch // dp_world, 1), 99)[:3])
    return ConfigError(
        f"train.global_batch_size = {global_batch} does not split evenly over {dp_world} "
        "data-parallel ranks: every rank must take the same number of sequences per step. "
        f"It splits over {fits} ranks; at {dp_world} ranks use a global batch that "
        f"{dp_world} divides (e.g. {near})."
    )


def batch_split(train: TrainConfig, *, dp_world: int) -> BatchSplit:
    """The split of ``train``'s step at ``dp_world`` data-parallel ranks ([Note: batch
    split]); raises ConfigError naming the field when it cannot split evenly."""
    if dp_world < 1:
        raise ValueError(f"dp_world must be >= 1, got {dp_world}")
    cap = train.micro_batch_size
    if train.global_batch_size is None:
        return BatchSplit(cap * train.grad_accum * dp_world, cap, train.grad_accum)
    if train.grad_accum != 1:
        raise ConfigError(
            f"train.grad_accum = {train.grad_accum} cannot be combined with "
            f"train.global_batch_size = {train.global_batch_size}: accumulation is derived "
            "from the global batch, the world size and train.micro_batch_size (the per-rank "
            "cap). Remove train.grad_accum, or unset train.global_batch_size."
        )
    global_batch = train.global_batch_size
    if global_batch % dp_world:
        raise _indivisible(global_batch, dp_world)
    per_rank = global_batch // dp_world
    accum = next(a for a in divisors(per_rank) if per_rank // a <= cap)
    return BatchSplit(global_batch, per_rank // accum, accum)
