"""``recommend()``: search the settings that trade memory for speed, rank what fits.

Searched, keeping the global batch (micro-batch x accumulation per rank) fixed:
parallel.strategy with every useful hybrid shard degree, for a mixture-of-experts
model parallel.ep (1 and the powers of two up to a node that divide its experts and
the shard group: all-to-alls stay inside a node), reshard_after_forward
(the strategy's default, or an int = ranks per node to reshard inside a node),
activation checkpointing (none, every 2nd block, every block, selective), CPU offload
(GPUs), the micro-batch size, and with accumulation how gradients are reduced
(parallel.accum_sync last or every: [Note: accumulation modes]). Each candidate is
planned analytically (a model only the traced planner can plan is traced cheapest
first, until enough fit); those that fit are ranked by an estimated step time — a
relative cost, not a prediction:

    step = max(compute + recompute, communication) + offload transfers

compute = FLOPs per token (fsdpkit.models.flops) at 40% of the device's peak, derated
for small micro-batches (x (1 + 256 / tokens per micro-batch): fewer tokens per matmul
run further below peak); recompute = a third of the checkpointed blocks' share, times
the share of a block's forward FLOPs that is recomputed (all of it under full
checkpointing; under selective the matmuls the policy does not save — k, o and up of
a Llama block, ~37% of llama3-8b's block forward at seq 8192 less attention, which
is saved), and of the output head's with the chunked loss (train.chunked_loss);
communication = all-gather + reduce-scatter bytes over the shard group's link (NVLink
inside a node, the network across) + replica all-reduce + 50 us per collective,
overlapped with compute as FSDP2 prefetching does; offload = host copies over PCIe
plus the CPU AdamW step (16 bytes per local parameter at host memory speed).
Ranking is by that time per token of the global batch (a tp x cp layout has fewer
data-parallel ranks: its step may read fewer tokens) and adds 2% per changed key, so
the config as given wins a near tie.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from fsdpkit.config import RunConfig, batch_split, with_changes
from fsdpkit.config.batch_split import divisors
from fsdpkit.devices import Device
from fsdpkit.errors import UserError
from fsdpkit.models.llama import LlamaConfig
from fsdpkit.planner.api import DEFAULT_MARGIN, plan_scenario
from fsdpkit.planner.errors import PlanError
from fsdpkit.planner.experts.routing import BALANCED, Routing
from fsdpkit.planner.pipeline.degrees import PIPELINE_GRID, pipeline_degrees
from fsdpkit.planner.search.layouts import POWERS, Layout, LayoutTry, choose, layout_groups
from fsdpkit.planner.search.recommendation import Candidate, Recommendation
from fsdpkit.planner.search.stepcost import StepCost, step_cost
from fsdpkit.planner.search.tracedsearch import ladders, moe_grid
from fsdpkit.planner.search.tracedsearch import search as traced_search
from fsdpkit.planner.shapes.scenario import Scenario, run_vocab_size, scenario
from fsdpkit.strategies import STRATEGIES

CHANGE_PENALTY = 0.02
"""Relative cost added per changed config key when ranking."""


def _hybrid_degrees(world: int, per_node: int) -> list[int]:
    """Shard degrees worth trying for HSDP: powers of two up to a node, node multiples."""
    return [
        d
        for d in divisors(world)
        if 1 < d < world and ((d <= per_node and d & (d - 1) == 0) or d % per_node == 0)
    ]


def _strategies(world: int, per_node: int) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for name, strategy in STRATEGIES.items():
        degrees = _hybrid_degrees(world, per_node) if strategy.hybrid else [None]
        out += [{"parallel.strategy": name, "parallel.shard_degree": d} for d in degrees]
    return out


def _reshards(strategy: dict[str, object], world: int, per_node: int) -> list[object]:
    shard = strategy["parallel.shard_degree"] or world
    options: list[object] = [None]
    reshards = STRATEGIES[str(strategy["parallel.strategy"])].reshards_after_forward
    if reshards and 1 < per_node < int(shard) and int(shard) % per_node == 0:  # type: ignore[call-overload]
        options.append(per_node)
    return options


def _micro_changes(
    cfg: RunConfig, *, world: int, smallest: bool = False
) -> list[dict[str, object]]:
    """Micro-batch choices that keep the global batch ([Note: batch split]): with
    train.global_batch_size set only the per-rank cap changes, else the product
    micro x accumulation per rank stays. The four largest micro-batches, or with
    ``smallest`` the two smallest (the most micro-batches: a pipeline's smallest bubble)."""
    total = batch_split(cfg.train, dp_world=world).per_rank
    micros = divisors(total)[:2] if smallest else divisors(total)[-4:]
    if cfg.train.global_batch_size is not None:
        return [{"train.micro_batch_size": m} for m in micros]
    return [{"train.micro_batch_size": m, "train.grad_accum": total // m} for m in micros]


def _eps(experts: int | None, *, per_node: int) -> list[dict[str, object]]:
    """``parallel.ep`` choices of a model with ``experts`` routed experts (none: dense);
    an ep that does not divide the shard group is refused by the config itself."""
    if experts is None:
        return [{}]
    return [{"parallel.ep": e} for e in POWERS if e <= per_node and experts % e == 0]


def _grid(
    cfg: RunConfig, *, world: int, per_node: int, gpu: bool, experts: int | None = None
) -> list[dict[str, object]]:
    micros = _micro_changes(cfg, world=world)
    acs = [("none", 2), ("every", 2), ("selective", 2), ("full", 2)]
    grid = []
    strategies = [
        s | e for s in _strategies(world, per_node) for e in _eps(experts, per_node=per_node)
    ]
    for strat in strategies:
        for raf, (ac, every), micro in itertools.product(
            _reshards(strat, world, per_node), acs, micros
        ):
            for offload, sync in itertools.product(
                (False, True) if gpu and raf is None else (False,), ("last", "every")
            ):
                grid.append(
                    strat
                    | {"parallel.reshard_after_forward": raf, "offload.params": offload}
                    | {"activations.mode": ac, "activations.every": every}
                    | {"parallel.accum_sync": sync}
                    | micro
                )
    return grid


def _diff(cfg: RunConfig, changes: dict[str, object]) -> dict[str, object]:
    """The keys that change; parallel.accum_sync = auto already means last where last
    fits ([Note: accum_sync auto]), so only every is a change from it."""
    current = cfg.to_dict()
    if current["parallel"]["accum_sync"] == "auto":
        current["parallel"]["accum_sync"] = "last"
    return {k: v for k, v in changes.items() if current[k.split(".")[0]][k.split(".")[1]] != v}


@dataclass(frozen=True)
class _Search:
    world: int
    device: Device
    margin: float
    per_node: int
    vocab: int | None
    experts: int | None = None
    """The model's routed experts per block (None: dense): parallel.ep is searched."""
    routing: Routing = BALANCED
    """How unevenly the router fills the ep ranks ([Note: routing in the plan]): the
    options with parallel.ep > 1 are planned at it, the others do not depend on it."""


@dataclass(frozen=True)
class _Option:
    """A valid configuration of the search, costed but not yet planned."""

    changes: dict[str, object]
    config: RunConfig
    scenario: Scenario
    cost: StepCost
    grid: dict[str, object] = field(default_factory=dict)
    """The grid point's keys, unchanged ones included ([Note: traced search])."""


def _option(cfg: RunConfig, changes: dict[str, object], search: _Search) -> _Option | None:
    try:
        new = with_changes(cfg, changes, source="the recommender")
        sc = scenario(
            new,
            world_size=search.world,
            device=search.device,
            ranks_per_node=search.per_node,
            vocab_size=search.vocab,
            routing=search.routing if new.parallel.ep > 1 else BALANCED,
        )
    except UserError:
        return None  # e.g. offload with grad_op: not a valid configuration
    if changes.get("parallel.accum_sync") == "every" and (
        sc.grad_accum == 1 or sc.dims.fsdp_shard == 1
    ):
        return None  # nothing is accumulated across micro-batches, or nothing sharded
    return _Option(_diff(cfg, changes), new, sc, step_cost(sc), grid=changes)


def _planned(o: _Option, search: _Search, *, shallow: bool = False) -> Candidate:
    """Plan an option; its cost again on the planned scenario (parallel.accum_sync =
    auto is decided by planning: [Note: accum_sync auto]). ``shallow``: a deep traced
    model from shallow traces ([Note: depth extrapolation])."""
    p = plan_scenario(o.scenario, cfg=o.config, margin=search.margin, shallow=shallow)
    return Candidate(o.changes, o.config, p, step_cost(p.scenario))


def _confirmed(fitting: list[Candidate], search: _Search) -> list[Candidate]:
    """``fitting`` with its first candidate planned at full depth where the search
    extrapolated it, dropping those that do not fit then ([Note: depth
    extrapolation])."""
    while fitting and any("extended to" in n for n in fitting[0].plan.memory.notes):
        c = fitting[0]
        full = _planned(_Option(c.changes, c.config, c.plan.scenario, c.cost), search)
        fitting = ([full] if full.fits else []) + fitting[1:]
    return fitting


def _per_token(c: Candidate | _Option) -> float:
    """Seconds per token of the global batch: a tp x cp layout has fewer data-parallel
    ranks, so its step reads fewer tokens (unless train.global_batch_size fixes them)."""
    sc = c.plan.scenario if isinstance(c, Candidate) else c.scenario
    return c.cost.total_s / max(sc.dims.dp * sc.tokens * sc.grad_accum, 1)


def _rank_key(c: Candidate | _Option) -> tuple[float, int]:
    peak = c.plan.memory.peak.bytes if isinstance(c, Candidate) else 0
    return _per_token(c) * (1 + CHANGE_PENALTY * len(c.changes)), peak


def _planned_options(options: list[_Option], search: _Search, *, top: int) -> list[Candidate]:
    """Plan every option analytically; a model only the traced planner can plan
    ([Note: planning any model]) is traced cheapest ladder first until ``top`` fit
    ([Note: traced search]: each trace runs the real model code, seconds, not
    microseconds)."""
    if all(o.scenario.analytic_why_not is None for o in options):
        return [_planned(o, search) for o in options]
    groups = ladders(options, changes=lambda o: o.grid, cost=_rank_key)
    return traced_search(
        groups, lambda o: _planned(o, search, shallow=True), lambda c: c.fits, top=top
    )


def recommend(
    cfg: RunConfig,
    *,
    world_size: int,
    device: Device,
    margin: float = DEFAULT_MARGIN,
    ranks_per_node: int = 8,
    vocab_size: int | None = None,
    top: int = 5,
    routing: Routing = BALANCED,
) -> Recommendation:
    """Search the tp x cp layout, strategy, mesh, resharding, checkpointing, offload and
    micro-batch for ``cfg`` on ``world_size`` ranks of ``device``; rank what fits by
    estimated step time. ``Recommendation.best.changes`` are the config keys to set.
    ``routing``: a MoE model's under ep, for the options with ep > 1 (default
    balanced; [Note: routing in the plan])."""
    if device.memory is None:
        raise PlanError(
            "--recommend needs the device memory to search what fits: pass --device-mem "
            "with a size (80GiB) or a known device (h100, a100-40gb, ...)."
        )
    vocab = vocab_size if vocab_size is not None else run_vocab_size(cfg)
    search = _Search(world_size, device, margin, ranks_per_node, vocab)
    given = _option(cfg, {}, search)
    if given is not None and given.scenario.experts is not None:
        search = replace(search, experts=given.scenario.experts.count, routing=routing)
        given = _option(cfg, {}, search)
    current = _planned(given, search) if given is not None else None
    shape = _shape(cfg, given, search)
    groups = layout_groups(
        shape,
        world=world_size,
        per_node=min(ranks_per_node, world_size),
        seq_len=cfg.data.seq_len,
        attention=cfg.parallel.cp_attention,
    )
    tries: list[LayoutTry] = []
    found: dict[tuple[int, int], list[Candidate]] = {}
    searched = 0
    bound = False  # a fitting layout waited on its traffic: the step time chooses
    for group in groups:
        for tp, cp, attention in group:
            options = _layout_options(cfg, layout=(tp, cp, attention), search=search)
            searched += len(options)
            found[(tp, cp)] = _planned_options(options, search, top=top)
            tries.append(_try((tp, cp, attention), found[(tp, cp)]))
        bound = bound or (any(t.fits for t in tries) and _traffic_bound(found))
        if any(t.fits for t in tries) and not _traffic_bound(found):
            break
    chosen = _fastest_group(found) if bound else choose(tries)
    pool = [c for (tp, cp), cs in found.items() if tp * cp == chosen for c in cs]
    candidates = [c for cs in found.values() for c in cs]
    fitting = sorted((c for c in pool if c.fits), key=_rank_key)
    if any(not c.config.offload.params for c in fitting):
        fitting = [c for c in fitting if not c.config.offload.params]
    fitting = _confirmed(fitting, search)
    unfit = sorted((c for c in candidates if not c.fits), key=_rank_key)
    best = fitting[0] if fitting else None
    cheaper = None
    if unfit and (best is None or _per_token(unfit[0]) < _per_token(best)):
        cheaper = unfit[0]
    return Recommendation(
        best=best,
        ranked=tuple(fitting[:top]),
        current=current,
        cheaper_unfit=cheaper,
        considered=len(candidates),
        fitting=sum(c.fits for c in candidates),
        searched=searched,
        layouts=tuple(tries),
    )


def _fastest(found: dict[tuple[int, int], list[Candidate]]) -> Candidate | None:
    """The fastest candidate found so far that fits without CPU offload."""
    fitting = [c for cs in found.values() for c in cs if c.fits and not c.config.offload.params]
    return min(fitting, key=_rank_key, default=None)


def _traffic_bound(found: dict[tuple[int, int], list[Candidate]]) -> bool:
    """Whether the fastest fitting candidate so far waits on its collectives (they
    take longer than its compute): then larger tp groups, with pp across the nodes,
    compete on step time ([Note: pipeline in the recommender])."""
    best = _fastest(found)
    return best is not None and best.cost.comm_s > best.cost.compute_s + best.cost.recompute_s


def _fastest_group(found: dict[tuple[int, int], list[Candidate]]) -> int | None:
    """tp x cp of the fastest fitting candidate."""
    best = _fastest(found)
    if best is None:
        return None
    return best.plan.scenario.dims.tp * best.plan.scenario.dims.cp


def _shape(cfg: RunConfig, given: _Option | None, search: _Search) -> LlamaConfig | None:
    """The Llama shape the layouts are searched for (None: not a Llama-shaped model the
    analytic planner knows, planned at tp = cp = 1 only)."""
    if given is None:  # the config as given is invalid here: resolve it as FSDP only
        fsdp_only = {"parallel.tp": 1, "parallel.cp": 1, "parallel.cp_attention": "ulysses"}
        given = _option(cfg, fsdp_only, search)
    if given is None or given.scenario.analytic_why_not is not None:
        return None
    return given.scenario.model


def _layout_options(cfg: RunConfig, *, layout: Layout, search: _Search) -> list[_Option]:
    """The valid configurations of the grid at one tp x cp layout (the data-parallel
    search runs over world / (tp x cp) ranks)."""
    tp, cp, attention = layout
    fixed = {"parallel.tp": tp, "parallel.cp": cp, "parallel.cp_attention": attention}
    dp = search.world // (tp * cp)
    per_node = max(min(search.per_node, search.world) // (tp * cp), 1)
    grid = _grid(
        cfg, world=dp, per_node=per_node, gpu=search.device.kind == "gpu", experts=search.experts
    )
    if search.experts is not None:  # a mixture-of-experts model is traced: [Note: traced search]
        grid = [g for g in grid if moe_grid(g, per_node=per_node)]
    per_world = min(search.per_node, search.world)
    for pp in pipeline_degrees(world=search.world, per_node=per_world):
        micros = _micro_changes(cfg, world=dp // pp, smallest=True)
        staged = {"parallel.pp": pp, "parallel.pp_split": "params"}
        pipelined = [staged | g | m for g in PIPELINE_GRID for m in micros]
        if search.experts is not None:  # each rank's stages traced: [Note: traced search]
            pipelined = [g for g in pipelined if moe_grid(g, per_node=per_node)]
        grid += pipelined
    options = (_option(cfg, fixed | changes, search) for changes in grid)
    return [o for o in options if o is not None]


def _try(layout: Layout, candidates: list[Candidate]) -> LayoutTry:
    tp, cp, attention = layout
    fitting = sorted((c for c in candidates if c.fits), key=_rank_key)
    resident = [c for c in fitting if not c.config.offload.params]
    lowest = sorted(candidates, key=lambda c: c.plan.memory.peak.bytes)
    if not (resident or fitting or lowest):
        return LayoutTry(tp, cp, None, None, attention=attention)
    closest = (resident or fitting or lowest)[0]
    p = closest.plan
    return LayoutTry(
        tp, cp, p.memory.peak.bytes, p.usable_bytes, dict(closest.changes),
        fits=bool(resident), fits_offloaded=bool(fitting), attention=attention,
    )  # fmt: skip
