"""Which ``parallel.tp`` x ``parallel.cp`` layouts the recommender tries, in which order,
and how it picks one.

[Note: layout search]
tp runs over the powers of two that divide the ranks per node (1, 2, 4, 8: a
tensor-parallel group exchanges activations several times per block and stays inside
a node) and the model's attention and key/value heads; cp over the powers of two that
divide the world / tp and the heads per tp rank, with cp x tp dividing data.seq_len
(each cp rank's slice is split again over tp: fsdpkit.config.dims). Layouts are tried in
groups of equal tp x cp, fewest model-parallel ranks first: every model-parallel rank
is a data-parallel rank fewer (a larger smallest global batch, more exchange traffic).
The first group in which something fits without CPU offload wins (offload moves
every parameter over PCIe each step, slower than any exchange inside a node); if no
group does, the first group in which something fits with offload. Inside the group
the estimated step time decides: tensor parallelism also divides the gathered
parameters and FSDP's traffic, so it wins for short sequences; context parallelism
exchanges less per block for GQA models (q, k, v and the output, not 4 x (m, d)), so
it wins once activations dominate (long sequences).

A cp layout is planned with the config's ``parallel.cp_attention`` where that scheme
admits it, else with the other (``attention``): Ulysses needs the heads per tp rank to
divide by cp, ring attention a data.seq_len that is a multiple of 2 x cp. So a model
whose heads Ulysses cannot split (28 heads at tp 4: 7 per rank) still gets cp layouts,
with ring attention; where both admit a layout the config's own is kept (Ulysses by
default: it holds and moves less per block than ring for GQA models).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fsdpkit.models.llama import LlamaConfig

POWERS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class LayoutTry:
    """One layout the recommender planned, and its closest candidate."""

    tp: int
    cp: int
    peak: int | None
    """Peak bytes of its closest candidate: the fitting one ranked first, else the one
    with the lowest peak (None: no valid configuration at this layout)."""
    usable: int | None
    """The usable bytes that peak was held against."""
    changes: dict[str, object] = field(default_factory=dict)
    """The closest candidate's config changes."""
    fits: bool = False
    """Something fits at this layout without CPU offload."""
    fits_offloaded: bool = False
    """Something fits at this layout with CPU offload."""
    attention: str = "ulysses"
    """``parallel.cp_attention`` planned (at cp > 1)."""

    @property
    def ranks(self) -> int:
        return self.tp * self.cp

    def describe(self) -> str:
        if self.ranks == 1:
            return "FSDP only"
        ring = " (ring attention)" if self.cp > 1 and self.attention == "ring" else ""
        parts = (f"{n} {d}" for n, d in (("tp", self.tp), ("cp", self.cp)) if d > 1)
        return " x ".join(parts) + ring


Layout = tuple[int, int, str]
"""(tp, cp, parallel.cp_attention)."""


def layout_groups(
    model: LlamaConfig | None,
    *,
    world: int,
    per_node: int,
    seq_len: int,
    attention: str = "ulysses",
) -> list[list[Layout]]:
    """(tp, cp, attention) layouts grouped by tp x cp, fewest first ([Note: layout
    search]); a model the analytic planner does not know is planned at (1, 1) only."""
    if model is None:
        return [[(1, 1, "ulysses")]]
    layouts = []
    for tp in (t for t in POWERS if t <= per_node and per_node % t == 0 and world % t == 0):
        if model.n_heads % tp or model.n_kv_heads % tp:
            continue
        for cp in POWERS:
            if (world // tp) % cp or seq_len % (cp * tp):
                continue
            schemes = cp_attentions(model, tp=tp, cp=cp, seq_len=seq_len, given=attention)
            if schemes:
                layouts.append((tp, cp, schemes[0]))
    products = sorted({tp * cp for tp, cp, _ in layouts})
    return [[lay for lay in layouts if lay[0] * lay[1] == p] for p in products]


def cp_attentions(
    model: LlamaConfig, *, tp: int, cp: int, seq_len: int, given: str
) -> tuple[str, ...]:
    """The attention schemes that admit ``cp`` ranks, the config's own (``given``) first
    ([Note: layout search]); ("ulysses",) without context parallelism."""
    if cp == 1:
        return ("ulysses",)
    admits = {"ulysses": (model.n_heads // tp) % cp == 0, "ring": seq_len % (2 * cp) == 0}
    order = (given, "ring" if given == "ulysses" else "ulysses")
    return tuple(a for a in order if admits[a])


def choose(tries: list[LayoutTry]) -> int | None:
    """The group (tp x cp) to recommend from: the fewest model-parallel ranks at which
    something fits without offload, else with offload, else None."""
    for offloaded in (False, True):
        ok = [t.ranks for t in tries if (t.fits_offloaded if offloaded else t.fits)]
        if ok:
            return min(ok)
    return None
