"""The exchanges inside one block, as events of its memory model (fsdpkit.planner.
blockmem): sequence parallelism's all-gathers and reduce-scatters around the norms,
tensor parallelism's row-parallel reductions, Ulysses' all-to-alls, and which of their
outputs selective checkpointing keeps ([Note: selective checkpointing of exchanges] in
fsdpkit.planner.replay.blockmem).
"""

from __future__ import annotations

from fsdpkit.planner.replay.blocksizes import ACT, TEMP, XCHG, Event, ForWeights, Sizes


def row_collective(s: Sizes) -> int:
    """Bytes of one row-parallel output's collective (reduce-scatter to n tokens, or
    all-reduce), 0 without tensor parallelism."""
    return s.nde if s.tp > 1 else 0


def ulysses(s: Sizes) -> bool:
    return s.cp > 1 and not s.ring


def exchange_saved(s: Sizes) -> int:
    """Bytes of the collectives' outputs selective checkpointing keeps per block
    ([Note: selective checkpointing of exchanges]): the two gathered inputs and the
    two reduced row-parallel outputs under tp, the four all-to-alls under Ulysses."""
    tp = 2 * (s.nme if s.sp else 0) + 2 * row_collective(s)
    return tp + (2 * s.nqe + 2 * s.nxe + positions(s) if ulysses(s) else 0)


def positions(s: Sizes) -> int:
    """The whole sequence's int64 position ids where a block gathers them (Ulysses)."""
    return 8 * s.cp * s.m if s.block_positions and ulysses(s) else 0


def kept(size: int, selective: bool) -> list[Event]:
    """A collective's output that the selective policy saves (``size`` 0: none)."""
    return [(ACT, size)] if selective and size else []


def gather(s: Sizes, *, selective: bool = False) -> list[Event]:
    """Sequence parallelism: a norm's output (``n`` tokens) all-gathered to the matmuls'
    ``m`` tokens; the gathered copy is what the projections read (and save), the shard
    dies; ``selective``: the collective's output is saved beside it. Nothing without
    sequence parallelism."""
    return [*kept(s.nme, selective), (XCHG, s.nme), (ACT, -s.nde)] if s.sp else []


def projection_input(s: Sizes) -> Event:
    """The tensor the q/k/v (gate/up) projections read, as (category, bytes): the norm's
    output, or its gathered copy under sequence parallelism."""
    return (XCHG, s.nme) if s.sp else (ACT, s.nde)


def row_add(s: Sizes, *, selective: bool = False) -> list[Event]:
    """A row-parallel output (live) into the residual: under sequence parallelism
    reduce-scattered first (a new ``n``-token tensor), else all-reduced (its copy
    transient, unmodeled); ``selective``: the collective's output is saved."""
    if selective and s.tp > 1:
        return [(ACT, row_collective(s)), (ACT, s.nde)]
    return [(TEMP, s.nde), (ACT, s.nde), (TEMP, -s.nde)] if s.sp else [(ACT, s.nde)]


def exchange(
    s: Sizes, size: int, *, ring_too: bool = False, saved: int = 0, selective: bool = False
) -> list[Event]:
    """Context parallelism: an all-to-all's output coexists with its input, which then
    dies (heads for sequence, and back). Ring attention exchanges none (``ring_too``:
    the one copy both make, the attention output made o_proj's input). ``selective``:
    the all-to-all's output (``saved`` bytes) is saved as well (Ulysses only)."""
    out = kept(saved, selective and ulysses(s))
    return [*out, (XCHG, size), (XCHG, -size)] if s.cp > 1 and (ring_too or not s.ring) else []


def grad_scatter(s: Sizes) -> list[Event]:
    """Sequence parallelism, backward: the gathered input's grad (``m`` tokens, live)
    reduce-scattered to the norm's output grad (``n`` tokens)."""
    return [(TEMP, s.nde), (TEMP, -s.nme)] if s.sp else []


def grad_gather(s: Sizes, sign: int, weights: bool = False) -> list[Event]:
    """Sequence parallelism, backward of a row-parallel output: the residual grad
    all-gathered to ``m`` tokens (``sign`` 1) until the input grad is made (-1);
    ``weights``: the weight's gradient is made from it too."""
    size = ForWeights(-s.nme) if weights and sign < 0 else sign * s.nme
    return [(XCHG, size)] if s.sp else []
