"""Traced memory of each pipeline rank: the trainer's own stages run by torch's own
schedule, under fake tensors, one rank at a time.

[Note: traced pipeline plans]
A pipelined run whose blocks the analytic model cannot replay (a mixture-of-experts
model: [Note: planning any model]) is planned as ``traced_memory`` plans one without
pp ([Note: traced planning]), once per pipeline rank: the fake process group takes the
rank of that pipeline coordinate, the trainer's builder makes that rank's stages
(``fsdpkit.trainable.build.shard_trainable``), and two steps of the trainer's
pipelined step run (``pipeline_step``: torch's schedule, the router sums carried
between the stages, clipping, AdamW); the second is counted, as the steady state. A
real run differs in three places, each set to what the real run does (measured on
torch 2.13 against bench/plan_pipeline_moe.py's real steps):

- metadata between ranks: torch's stages infer their shapes at the first step by
  sending metadata objects to the next and previous rank, which a fake process group
  cannot deliver. Every stage boundary carries the same tensors (the hidden state and,
  for a router loss, the per-expert sums: [Note: the router loss across stages]), so
  the metadata the first stage sends is kept and handed to every stage that waits for
  one (the gradients' derived from it, as torch derives them); the ranks are traced
  in order, first stage first. The warm-up vote between the ranks (static or dynamic
  inference) is skipped for the dynamic inference a real run votes for.
- sends: a gloo or NCCL work holds the tensor it sends until the schedule drops it
  ([Note: pipeline sends] in fsdpkit.planner.pipeline.replay), a fake one holds
  nothing; each traced send's work holds its tensors (without this the first stage of
  a 1F1B pp4 read 3 hidden states low, one per warm-up forward).
- receive buffers: torch allocates them in the first step and keeps them; made before
  the counted step, the tracker would count each only from its first use (one hidden
  state per micro-batch low by the stage's last backward), so they are counted from
  the start.

The check that every pipeline rank trains something gathers a flag from each rank,
which a fake group cannot; it is skipped (the trainer runs it). Measured (4 gloo
ranks, fp32, bench/plan_pipeline_moe.py): the built-in MoE's 1F1B pp2 and pp2 x dp2
ranks within 0.01% of their typical real step; a dense model's traced ranks equal its
analytic ones (within 0.01%) under 1F1B, GPipe and pp4. torch's zero-bubble schedules
are not traced (``traceable`` says why): their input pass runs ``autograd.grad`` over
the stage, during which torch's module tracker asks autograd about the receive
buffers (leaves) and fails; with the tracker's hooks kept off the leaves the trace
runs, but a dense model's ranks then read 4-34% above their real peaks (ZBVZeroBubble,
InterleavedZeroBubble, DualPipeV on pp2 x dp2; the analytic plan is exact there).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining import stage as torch_stage
from torch.distributed.pipelining._utils import _StageBackwardMeta, _StageForwardMeta

from fsdpkit.config import RunConfig
from fsdpkit.config.schedules import SCHEDULES
from fsdpkit.planner.errors import PlanError
from fsdpkit.planner.experts.routing import BALANCED, call_loads
from fsdpkit.planner.pipeline.tied import twin_elements
from fsdpkit.planner.replay.analytic import late_free_spread
from fsdpkit.planner.shapes.result import MemoryPlan, PeakPoint
from fsdpkit.planner.shapes.scenario import Scenario
from fsdpkit.planner.shapes.states import stages_states
from fsdpkit.planner.traced.fake_patches import faithful_step, paused, wrapped
from fsdpkit.planner.traced.trace import PhaseRecorder, fake_trainable, fake_world
from fsdpkit.planner.traced.tracker import StagesTracker, model_gloo_buffers
from fsdpkit.sharding.pipeline import routing, tied
from fsdpkit.sharding.pipeline.split import StageSplit
from fsdpkit.trainable.pipeline import build
from fsdpkit.trainable.pipeline.step import pipeline_step
from fsdpkit.trainable.step import synthetic_batches

CPU = torch.device("cpu")


def traceable(schedule: str) -> str | None:
    """Why ``schedule``'s pipelined steps cannot be traced (None: they can)."""
    if SCHEDULES[schedule].zero_bubble:
        return (
            f"{schedule} splits each backward into an input pass (torch's autograd.grad "
            "over the stage), which torch's memory tracker cannot follow; with that "
            "worked around, a dense model's traced ranks read 4-34% above their real "
            "peaks (its analytic plan is exact), so such a trace is not used"
        )
    return None


@dataclass(frozen=True)
class RankTrace:
    """One pipeline rank's counted step."""

    peak: PeakPoint
    phase_peaks: dict[str, int]


@dataclass
class _Mailbox:
    """The stage metadata a traced rank sent, for the ranks traced after it."""

    forward: _StageForwardMeta | None = None

    def receive(self, stage: Any, src: int) -> Any:
        if self.forward is None:
            raise PlanError(
                "traced pipeline plan: a stage waited for its input's shape before the "
                "first stage sent one (trace the pipeline ranks first stage first)."
            )
        if src < stage.stage_index:
            return self.forward
        grads = torch_stage._derive_grad_metas(self.forward.forward_metas)
        return _StageBackwardMeta(backward_metas=grads)

    def send(self, meta: Any) -> None:
        if isinstance(meta, _StageForwardMeta) and self.forward is None:
            self.forward = meta


class _HeldWork:
    """A fake process group's work that holds the tensors it sends, as gloo's and
    NCCL's works do until they are dropped."""

    def __init__(self, work: Any, sends: list[torch.Tensor]) -> None:
        self.work, self.sends = work, sends

    def wait(self) -> Any:
        return None if self.work is None else self.work.wait()


@contextlib.contextmanager
def _one_process_pipeline(mail: _Mailbox) -> Iterator[None]:
    """torch's stages and schedules with their exchanges between ranks done in this
    process ([Note: traced pipeline plans])."""

    def recv_meta(original: Any) -> Any:
        return lambda self, src_stage: mail.receive(self, src_stage)

    def send_meta(original: Any) -> Any:
        return lambda self, meta, dst_stage: mail.send(meta)

    def dynamic(original: Any) -> Any:
        def vote(self: Any, stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
            for s in stages:
                s._inference_mode = torch_stage.InferenceMode.DYNAMIC

        return vote

    def held(original: Any) -> Any:
        def batch(ops: list[dist.P2POp], desc: str | None = None) -> list[_HeldWork]:
            sends = [op.tensor for op in ops if op.op is dist.isend]
            return [_HeldWork(w, sends) for w in original(ops, desc=desc)] or [
                _HeldWork(None, sends)
            ]

        return batch

    def unchecked(original: Any) -> Any:
        return lambda pipeline, view: None

    with contextlib.ExitStack() as stack:
        stage_cls = torch_stage.PipelineStage
        stack.enter_context(wrapped(stage_cls, "_recv_meta", recv_meta))
        stack.enter_context(wrapped(stage_cls, "_send_meta", send_meta))
        stack.enter_context(wrapped(torch_schedules._PipelineSchedule, "_warmup_p2p", dynamic))
        stack.enter_context(wrapped(torch_schedules, "_batch_p2p", held))
        stack.enter_context(wrapped(build, "_require_something_to_train", unchecked))
        stack.enter_context(wrapped(tied, "tie_group", paused))  # reads the mesh's ranks
        for owner in (routing, build):  # a probe of the router loss on real numbers
            stack.enter_context(wrapped(owner, "takes_sums", paused))
        yield


def traced_ranks(
    cfg: RunConfig, sc: Scenario, scs: dict[int, Scenario], split: StageSplit
) -> list[MemoryPlan]:
    """Each pipeline rank's memory traced, with its stages' model states (``scs``: each
    stage's scenario, fsdpkit.planner.pipeline.plan.stage_scenario)."""
    out = []
    for r, trace in enumerate(traced_pipeline_memory(cfg, sc)):
        local = [scs[s] for s in split.local(r)]
        twin = twin_elements(sc, scs, local=split.local(r))
        out.append(
            MemoryPlan(
                mode="traced",
                peak=trace.peak,
                phase_peaks=trace.phase_peaks,
                model_states=stages_states(local, twin=twin),
                host_bytes=0,
                spread=max(late_free_spread(x) for x in local),
            )
        )
    return out


def traced_pipeline_memory(cfg: RunConfig, sc: Scenario) -> list[RankTrace]:
    """Each pipeline rank's counted step, in pipeline order ([Note: traced pipeline
    plans]). Starts and destroys its own fake process group per rank, so it must run in
    a process without one."""
    why = traceable(cfg.parallel.pp_schedule)
    if why is not None:
        raise PlanError(f"parallel.pp_schedule: this pipelined run cannot be traced ({why}).")
    mail = _Mailbox()
    out = []
    with _one_process_pipeline(mail):
        for pp_rank in range(sc.dims.pp):
            out.append(_traced_rank(cfg, sc, rank=pp_rank * sc.dims.stage_world))
    return out


def _traced_rank(cfg: RunConfig, sc: Scenario, *, rank: int) -> RankTrace:
    what = sc.source or "the model"
    failed = f"tracing pipeline rank {sc.dims.pp_rank(rank)}'s steps of {what}"
    advice = (
        "Plan the run with parallel.pp = 1 for the whole model's memory, or measure a few "
        "real steps."
    )
    with fake_world(sc, rank=rank, failed=failed, advice=advice):
        recorder = _trace(cfg, sc)
    phase, (total, where, parts) = max(recorder.peaks.items(), key=lambda kv: kv[1][0])
    where = where.replace(" of part.", " of ").replace(" of model.", " of ")  # the stage's part
    return RankTrace(
        peak=PeakPoint(total, phase, where, parts),
        phase_peaks={k: v[0] for k, v in recorder.peaks.items()},
    )


def _trace(cfg: RunConfig, sc: Scenario) -> PhaseRecorder:
    """Two pipelined steps of this rank's stages, the second counted action by action."""
    run, run_cfg, fake = fake_trainable(cfg, sc)
    with fake:
        pipe = run.pipeline
        assert pipe is not None
        if sc.device.kind == "cpu" and sc.dims.fsdp_shard > 1:
            for stage in pipe.stages:
                model_gloo_buffers(stage)
        batches = synthetic_batches(run_cfg, dp_world=sc.dims.dp, vocab_size=sc.vocab_size)
        clip = run_cfg.train.grad_clip
        loads = _rank_loads(sc, blocks=[b for s in pipe.stages for b in pipe.split.blocks[s.stage]])
        with faithful_step(loads=loads):  # torch's receive buffers, AdamW's states
            pipeline_step(pipe, run.model, run.optimizer, batches, max_norm=clip)
        tracker = StagesTracker(list(pipe.stages), run.optimizer, held=_receive_buffers(pipe))
        tracker.track_inputs(tuple(batches))
        recorder = PhaseRecorder(tracker, interleaved=True)
        with tracker, faithful_step(loads=loads), _marked(recorder), warnings.catch_warnings():
            # torch's module tracker warns of forwards and backwards that interleave:
            # the schedule's, by design (the plan reads the step's totals)
            warnings.filterwarnings("ignore", message="The module hierarchy tracking")
            pipeline_step(pipe, run.model, run.optimizer, batches, max_norm=clip)
            recorder("optimizer step")
    return recorder


def _rank_loads(sc: Scenario, *, blocks: list[int]) -> tuple[tuple[float, ...], ...]:
    """The routing of this rank's MoE layers under ep, in forward order ([Note: routing
    in the plan]; empty: balanced): a recorded routing's loads of these layers, or the
    mean and busiest layer applied to the rank's own layers."""
    if sc.experts is None or sc.dims.ep == 1 or sc.routing == BALANCED:
        return ()
    order = [b for b in range(len(sc.layout.blocks)) if any(sc.layout.routed[b])]
    mine = [order.index(b) for b in blocks if b in order]
    if sc.routing.by_call or sc.routing.by_layer:
        every = call_loads(sc.routing, layers=len(order))
        return tuple(every[i] for i in mine)
    return call_loads(sc.routing, layers=len(mine))


def _receive_buffers(pipe: Any) -> tuple[torch.Tensor, ...]:
    """The receive buffers torch's stages of this rank keep between steps."""
    schedule = pipe.schedule
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    out = []
    for stage in stages:
        for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
            out += [i.buffer for i in infos if getattr(i, "buffer", None) is not None]
    return tuple(out)


@contextlib.contextmanager
def _marked(recorder: PhaseRecorder) -> Iterator[None]:
    """Each forward and backward action of the schedule ends a phase of the recorder."""

    def ends(phase: str) -> Any:
        def wrap(original: Any) -> Any:
            def action(self: Any, *args: Any, **kwargs: Any) -> Any:
                out = original(self, *args, **kwargs)
                recorder(phase)
                return out

            return action

        return wrap

    base = torch_stage._PipelineStageBase
    with contextlib.ExitStack() as stack:
        stack.enter_context(wrapped(base, "forward_one_chunk", ends("forward")))
        stack.enter_context(wrapped(base, "backward_one_chunk", ends("backward")))
        yield
