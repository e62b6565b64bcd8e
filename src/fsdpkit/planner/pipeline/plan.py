"""The planner's view of pipeline parallelism (``parallel.pp``): each pipeline rank's
memory, the schedule's bubble and the stage-to-stage traffic.

[Note: pipeline plans]
The stages are the trainer's ([Note: stage split], ``stage_split`` on the model's own
block sizes), each sharded as ``shard()`` shards a stage ([Note: stage modules]): its
blocks' units, the embedding's unit on the first stage, the final norm's and head's on
the last, over the stage's own ranks. A rank's step is the sequence of actions torch's
schedule gives that rank (``schedule_actions``: F, B — or I and W for the zero-bubble
schedules — per stage and micro-batch, and each stage's REDUCE_GRAD after its last
backward), replayed over one ledger (fsdpkit.planner.pipeline.replay): the memory of
a stage is its weights and states, plus the activations of every micro-batch the
schedule keeps in flight on it (1F1B: ``pp - rank`` at most, GPipe: all of them), plus
what torch's stages hold ([Note: what a pipeline stage holds]). The plan of the run is
the rank with the highest peak (every rank must fit); ``fsdpkit plan`` lists them all.
A model whose blocks the replay does not cover (a mixture-of-experts model) has each
rank's memory traced instead ([Note: traced pipeline plans] in
fsdpkit.planner.pipeline.traced); its units, traffic and bubble are planned as here.

The bubble is the idle share of a rank's step when every action takes its stage's
compute (a forward 1 x, a backward 2 x, an input or weight half 1 x, each
proportional to the stage's matmul parameters, the head counted on the last stage)
and waits for the action it depends on (the forward of the previous stage, the
backward of the next); for 1F1B over equal stages it is (pp - 1) / (n + pp - 1). The
p2p traffic is what each rank sends per step: the hidden state of every micro-batch
to the next stage's rank, its gradient to the previous one's (stages on one rank pass
them in memory).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

from fsdpkit.config import RunConfig
from fsdpkit.config.schedules import SCHEDULES, stage_rank, stages_per_rank
from fsdpkit.planner.experts.parallel import ep_units
from fsdpkit.planner.model.dpo_reference import reference_terms
from fsdpkit.planner.model.unit_layout import EdgeLayout, ModelLayout, Unit, Units
from fsdpkit.planner.pipeline.tied import tied_index, twin_elements, with_tie_all_reduce
from fsdpkit.planner.replay.sizing import hidden_bytes
from fsdpkit.planner.shapes.mparallel import tp_layout
from fsdpkit.planner.shapes.result import CommVolume, MemoryPlan
from fsdpkit.planner.shapes.scenario import Scenario
from fsdpkit.sharding.pipeline.split import StageSplit, stage_split

Action = tuple[str, int, int]
"""(kind, stage, micro-batch): kind F, B, I, W, or R (REDUCE_GRAD, micro-batch -1)."""


@functools.cache
def schedule_actions(name: str, *, pp: int, per_rank: int, n: int) -> dict[int, tuple[Action, ...]]:
    """The compute actions torch's schedule ``name`` runs on each pipeline rank, in
    order (torch builds its own order from stand-ins for the stages: no process group
    is needed). Composite overlapped actions (DualPipeV) are listed as their parts."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    spec, stages = SCHEDULES[name], pp * per_rank
    out: dict[int, tuple[Action, ...]] = {}
    for rank in range(pp):
        local = [s for s in range(stages) if stage_rank(s, pp=pp, style=spec.style) == rank]
        standins = [_standin(s, stages=stages, pp=pp, rank=rank) for s in local]
        schedule = get_schedule_class(name)(
            standins if spec.looped else standins[0], n_microbatches=n
        )
        out[rank] = _actions(schedule.pipeline_order[rank], n=n, single=not spec.looped)
    return out


def _standin(stage: int, *, stages: int, pp: int, rank: int) -> SimpleNamespace:
    """What torch's schedules read of a PipelineStage to lay out their order."""
    import torch

    return SimpleNamespace(
        num_stages=stages,
        group_size=pp,
        group_rank=rank,
        stage_index=stage,
        is_first=stage == 0,
        is_last=stage == stages - 1,
        submod=torch.nn.Module(),
        stage_index_to_group_rank=None,
    )


def _actions(order: list[Any], *, n: int, single: bool) -> tuple[Action, ...]:
    flat: list[Action] = []
    for action in order:
        if action is None:
            continue
        for part in action.sub_actions or (action,):
            kind = part.computation_type.value
            if kind in ("F", "B", "I", "W"):
                flat.append((kind, part.stage_index, part.microbatch_index))
    if single:  # torch's one-stage IR numbers a rank's micro-batches from its first forward
        flat = _renumbered(flat)
    return _with_reduce(flat, n=n)


def _renumbered(actions: list[Action]) -> list[Action]:
    counts: dict[str, int] = {}
    out = []
    for kind, stage, _ in actions:
        out.append((kind, stage, counts.get(kind, 0)))
        counts[kind] = counts.get(kind, 0) + 1
    return out


def _with_reduce(actions: list[Action], *, n: int) -> tuple[Action, ...]:
    """Each stage's REDUCE_GRAD right after its last backward (torch's ``_add_reduce_grad``)."""
    out: list[Action] = []
    done: dict[int, int] = {}
    for action in actions:
        out.append(action)
        kind, stage, _ = action
        if kind in ("B", "W"):
            done[stage] = done.get(stage, 0) + 1
            if done[stage] == n:
                out.append(("R", stage, -1))
    return tuple(out)


def pipeline_split(cfg: RunConfig, layout: ModelLayout) -> StageSplit:
    """The trainer's split of this model ([Note: stage split]) from its layout."""
    per_block = [sum(r * c for r, c in block) for block in layout.blocks]
    edge = {e.role: sum(r * c for r, c in e.shapes) for e in layout.edges}
    root = sum(r * c for r, c in layout.root)  # the final norm when the head is in the root
    tied = tied_index(layout)  # on the first stage too ([Note: tied stages in the plan])
    first = edge.get("embedding", 0) + (math.prod(layout.root[tied]) if tied is not None else 0)
    last = edge.get("norm", 0) + edge.get("head", 0) + root
    return stage_split(cfg, block_params=per_block, edge_params=(first, last))


def stage_units(
    cfg: RunConfig, sc: Scenario, split: StageSplit, stage: int
) -> tuple[Units, tuple[Unit, ...]]:
    """The units ``shard()`` builds for ``stage`` of ``sc``'s model (its tp-local
    shapes, over the stage's shard group), and its blocks' experts units under ep
    ([Note: expert units])."""
    local = tp_layout(sc.layout, tp=sc.dims.tp, vocab=sc.vocab_size if sc.vocab_parallel else None)
    first, last = stage == 0, stage == split.stages - 1
    roles = ({"embedding"} if first else set()) | ({"norm", "head"} if last else set())
    edges = tuple(e for e in local.edges if e.role in roles)
    tied = tied_index(sc.layout)
    if tied is not None and first:  # [Note: tied stages in the plan]
        frozen = (local.root_frozen[tied],) if local.root_frozen else ()
        edges = (EdgeLayout(role="embedding", shapes=(local.root[tied],), frozen=frozen), *edges)
    part = replace(
        local,
        blocks=tuple(local.blocks[b] for b in split.blocks[stage]),
        frozen=tuple(local.frozen[b] for b in split.blocks[stage]) if local.frozen else (),
        routed=tuple(local.routed[b] for b in split.blocks[stage]) if local.routed else (),
        edges=edges,
        root=local.root if last else (),
    )
    shard, ep = sc.dims.fsdp_shard, sc.dims.ep
    return ep_units(part, shard=shard, ep=ep, parallel=cfg.parallel, activations=cfg.activations)


def stage_scenario(cfg: RunConfig, sc: Scenario, split: StageSplit, stage: int) -> Scenario:
    """``sc`` restricted to one stage's units (named by the model's block indices), and
    to that stage of DPO's separate reference."""
    made, experts = stage_units(cfg, sc, split, stage)
    offset = split.blocks[stage][0]
    untied = replace(sc.model, tie_embeddings=False) if sc.model is not None else None
    return sc.with_(
        root=made.root,
        edges=made.edges,
        units=tuple(_shifted(u, offset) for u in made.blocks),
        expert_units=tuple(_shifted(u, offset) for u in experts),
        model=untied,
        **_stage_reference(cfg, sc, made, last=stage == split.stages - 1),
    )


def _stage_reference(cfg: RunConfig, sc: Scenario, made: Units, *, last: bool) -> dict[str, int]:
    """DPO's separate reference in one stage ([Note: reference in the plan];
    [Note: preference pairs through pipeline stages] in fsdpkit.trainable.pipeline.
    preference): the stage's units of it, and its forward's logits on the last stage
    only."""
    if not sc.reference_bytes or sc.grpo is not None:
        return {}
    terms = reference_terms(
        cfg,
        units=(made.root, *made.edges, *made.blocks),
        rows=sc.micro_batch,
        seq_len=sc.seq_len,
        vocab=sc.vocab_size if last else 0,
        low=sc.param_bytes == 2,
    )
    return {"reference_bytes": terms.resident, "reference_forward": terms.forward}


def _shifted(u: Unit, offset: int) -> Unit:
    """A stage's unit under the model's block indices ("layers.4-5", not "layers.0-1";
    an experts unit "layers.4.experts")."""
    first, _, rest = u.name.removeprefix("layers.").partition(".")
    first, _, last = first.partition("-")
    name = str(int(first) + offset) + (f"-{int(last) + offset}" if last else "")
    name = f"layers.{name}" + (f".{rest}" if rest else "")
    return replace(u, name=name, blocks=tuple(b + offset for b in u.blocks))


@dataclass(frozen=True)
class RankPlan:
    """One pipeline rank's stages, memory and traffic."""

    rank: int
    stages: tuple[int, ...]
    memory: MemoryPlan
    p2p_bytes: int
    """Bytes this rank sends to other pipeline ranks per step (hidden states forward,
    their gradients backward)."""
    comm: CommVolume
    """Its stages' FSDP2 collectives (and tp / cp exchanges) per step."""


@dataclass(frozen=True)
class PipelinePlan:
    """Every pipeline rank's plan ([Note: pipeline plans])."""

    schedule: str
    pp: int
    stages_per_rank: int
    micro_batches: int
    split: StageSplit
    ranks: tuple[RankPlan, ...]
    bubble: float
    """Idle share of a step, averaged over the pipeline ranks."""

    @property
    def worst(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.memory.peak.bytes)

    @property
    def p2p_bytes(self) -> int:
        return max(r.p2p_bytes for r in self.ranks)


def stage_costs(sc: Scenario, split: StageSplit) -> list[float]:
    """Relative compute of each stage: its blocks' matmul parameters, the head's on
    the last stage (the embedding is a lookup)."""
    per_block = [sum(r * c for r, c in block if c > 1) for block in sc.layout.blocks]
    head = sum(r * c for e in sc.layout.edges if e.role == "head" for r, c in e.shapes)
    costs = [float(sum(per_block[b] for b in run)) for run in split.blocks]
    costs[-1] += head
    return costs


def bubble_fraction(actions: dict[int, tuple[Action, ...]], *, costs: list[float]) -> float:
    """The idle share of the step over all pipeline ranks ([Note: pipeline plans])."""
    weight = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    last = len(costs) - 1
    done: dict[Action, float] = {}
    free = dict.fromkeys(actions, 0.0)
    busy = dict.fromkeys(actions, 0.0)
    todo = {r: [a for a in acts if a[0] != "R"] for r, acts in actions.items()}
    position = dict.fromkeys(actions, 0)
    while any(position[r] < len(todo[r]) for r in todo):
        progressed = False
        for r, acts in todo.items():
            while position[r] < len(acts):
                kind, stage, mb = acts[position[r]]
                deps = _deps(kind, stage, mb, last=last)
                if any(d not in done for d in deps):
                    break
                start = max([free[r], *(done[d] for d in deps)])
                took = weight[kind] * costs[stage]
                done[(kind, stage, mb)] = free[r] = start + took
                if kind in ("B", "I"):  # the input's gradient is ready for the previous stage
                    done[("G", stage, mb)] = start + took
                busy[r] += took
                position[r] += 1
                progressed = True
        if not progressed:
            raise ValueError("pipeline schedule simulation made no progress")
    span = max(free.values())
    return 1.0 - sum(busy.values()) / (len(actions) * span) if span else 0.0


def _deps(kind: str, stage: int, mb: int, *, last: int) -> list[Action]:
    if kind == "F":
        return [("F", stage - 1, mb)] if stage > 0 else []
    if kind == "W":
        return [("I", stage, mb)]
    return [("F", stage, mb), *([] if stage == last else [("G", stage + 1, mb)])]


def p2p_bytes(sc: Scenario, split: StageSplit, *, rank: int, n: int) -> int:
    """Bytes ``rank`` sends per step: each of its stages' output to the next stage's
    rank and its input's gradient to the previous one's, per micro-batch."""
    hidden = hidden_bytes(sc)  # one micro-batch's hidden state on this rank
    sent = 0
    for s in split.local(rank):
        if s + 1 < split.stages and split.ranks[s + 1] != rank:
            sent += n * hidden
        if s > 0 and split.ranks[s - 1] != rank:
            sent += n * hidden
    return sent


def stages_of(cfg: RunConfig) -> int:
    """Stages per pipeline rank of ``cfg``."""
    p = cfg.parallel
    return stages_per_rank(schedule=p.pp_schedule, configured=p.pp_stages_per_rank)


def pipeline_plan(cfg: RunConfig, sc: Scenario) -> PipelinePlan:
    """Every pipeline rank's memory and traffic, and the bubble, of ``sc`` ([Note:
    pipeline plans]); ``cfg`` holds the schedule and the split."""
    from fsdpkit.planner.pipeline.replay import rank_memory, rank_scenario
    from fsdpkit.planner.replay.comm import comm_volume

    p, n = cfg.parallel, sc.grad_accum
    split = pipeline_split(cfg, sc.layout)
    per_rank = stages_of(cfg)
    actions = schedule_actions(p.pp_schedule, pp=p.pp, per_rank=per_rank, n=n)
    scs = {s: stage_scenario(cfg, sc, split, s) for s in range(split.stages)}
    traced = None
    if sc.analytic_why_not is not None:  # [Note: traced pipeline plans]
        from fsdpkit.planner.pipeline.traced import traced_ranks

        traced = traced_ranks(cfg, sc, scs, split)
    ranks = []
    for r in range(p.pp):
        local = {s: scs[s] for s in split.local(r)}
        if traced is not None:
            memory = traced[r]
        else:
            memory = rank_memory(
                local,
                actions[r],
                last_stage=split.stages - 1,
                micro_batches=n,
                schedule=p.pp_schedule,
                tied=tied_index(sc.layout) is not None,
                twin=twin_elements(sc, scs, local=list(local)),
            )
        comm = comm_volume(rank_scenario(list(local.values())))
        ranks.append(
            RankPlan(
                rank=r,
                stages=tuple(local),
                memory=memory,
                p2p_bytes=p2p_bytes(sc, split, rank=r, n=n),
                comm=with_tie_all_reduce(comm, sc, scs, local=list(local)),
            )
        )
    return PipelinePlan(
        schedule=p.pp_schedule,
        pp=p.pp,
        stages_per_rank=per_rank,
        micro_batches=n,
        split=split,
        ranks=tuple(ranks),
        bubble=bubble_fraction(actions, costs=stage_costs(sc, split)),
    )
