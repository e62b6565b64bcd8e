"""Traced per-rank memory: the real model code, one real step, no devices.

[Note: traced planning]
The model is built under ``FakeTensorMode`` (tensors with shapes, no storage),
sharded by ``fsdpkit.shard`` on a mesh of the "fake" process group (every collective
returns at once, at any world size, in this one process), and one steady-state
training step (``fsdpkit.trainable.step.train_step``, the trainer's own) runs under torch's
``FSDPMemTracker``, which
counts every tensor storage as it is created and freed. What it measures is rank 0 of
that world. Limits, all measured on torch 2.13:

- The device is modeled as the CPU: a fake "cuda" device fails inside ``fully_shard``.
  CPU and GPU differ in a few op workspaces (attention backward, embedding backward),
  which the analytic planner adds for GPUs and this mode does not.
- The mesh is the run's own N-D mesh ([Note: parallel dimensions]: replicate x
  shard x cp x tp), built outside ``FakeTensorMode``; every data-parallel rank gets
  its batch (cp ranks slice theirs). What tensor and context parallelism compute from
  tensor values or outside any tracker (mesh rank tensors, the built-in Llama's
  document mask, DTensor's global-shape metadata) is set to the real run's answer in
  fsdpkit.planner.traced.fake_patches, one note each; DTensor's caches of meshes are dropped
  around every trace ([Note: equal meshes] in fsdpkit.sharding.mesh). Gradient
  clipping runs tensor by tensor: fake tracing of ``clip_grad_norm_(foreach=True)``
  on DTensor gradients counts a copy of every gradient (seen at world size 1), the
  real kernel does not. The optimizer is the trainer's foreach AdamW, which traces exactly.
- Collective-internal buffers of a real backend are invisible to the tracker; gloo's
  are modeled (FSDP2's and ring attention's gathers), and two ways torch's tracker
  miscounts a unit are fixed, in fsdpkit.planner.traced.tracker.
- Fake tensors are tensor subclasses, for which autograd sums two gradients of one
  tensor out of place; a real run adds a tied embedding's gradient in place into the
  chunked loss's head gradient. The trace's chunked loss therefore sums the head's
  gradient into ``.grad`` itself (``ChunkedLoss.grad_into_weight``), when and where the
  real run's autograd does ([Note: the head's gradient under fake tensors] in
  fsdpkit.loss.chunked_ce: beside an accumulated ``.grad`` until the embedding's
  gradient is in), which holds what the real run holds (inside context parallelism's
  slicing wrapper too, ``ContextParallelLoss``; a closure there once hid it: +2.4% on
  a tp2 x cp2 row).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdpkit.config import RunConfig, with_changes
from fsdpkit.errors import UserError
from fsdpkit.loss.contract import LossFn
from fsdpkit.loss.head import ChunkedLoss
from fsdpkit.loss.router import RouterLoss
from fsdpkit.planner.errors import PlanError, TraceError
from fsdpkit.planner.experts.routing import BALANCED, call_loads
from fsdpkit.planner.replay.analytic import late_free_spread
from fsdpkit.planner.shapes.result import CATEGORIES, MemoryPlan, PeakPoint
from fsdpkit.planner.shapes.scenario import Scenario
from fsdpkit.planner.shapes.states import model_states
from fsdpkit.planner.traced.fake_patches import faithful_step, real_meshes
from fsdpkit.planner.traced.tracker import UnitTracker, model_gloo_buffers, ring_gloo_buffers
from fsdpkit.sharding.context.batch import ContextParallelLoss
from fsdpkit.sharding.mesh import build_mesh, forget_meshes
from fsdpkit.trainable.build import Trainable, build_unsharded, shard_trainable
from fsdpkit.trainable.step import step_options, synthetic_batches, train_step

CPU = torch.device("cpu")

_CATEGORY = {
    "Sharded Param": "sharded_params",
    "Unsharded Param": "unsharded_params",
    "Buffer": "buffers_inputs",
    "Inputs": "buffers_inputs",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "unsharded_grads",
    "Activation": "activations",
    "Temp": "temporaries",
    "All Gather": "collective_buffers",
    "Reduce Scatter": "collective_buffers",
    "OptState": "optimizer_states",
}


def _breakdown(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    for per_device in snapshot.values():
        for ref, nbytes in per_device.items():
            key = _CATEGORY.get(getattr(ref, "value", str(ref)))
            if key is not None:
                out[key] += nbytes
    return out


class PhaseRecorder:
    """Per-phase peaks from one tracker: at each phase end, read the running peak and
    restart it from the current total (the tracker itself keeps one global peak)."""

    def __init__(self, tracker: FSDPMemTracker, *, interleaved: bool = False) -> None:
        """``interleaved``: micro-batches interleave their forwards and backwards (a
        pipeline schedule), so the tracker's per-module state lives for the whole step."""
        self.tracker = tracker
        self.interleaved = interleaved
        self.peaks: dict[str, tuple[int, str, dict[str, int]]] = {}

    def __call__(self, phase: str) -> None:
        peak = self.tracker.get_tracker_snapshot("peak")
        total = sum(d.get("Total", 0) for d in peak.values())
        if total > self.peaks.get(phase, (-1, "", {}))[0]:
            self.peaks[phase] = (total, _where(self.tracker, total), _breakdown(peak))
        current = self.tracker.get_tracker_snapshot("current")
        # Private state of MemTracker: restart the running peak at the current total.
        self.tracker._peak_mem = {dev: snap.get("Total", 0) for dev, snap in current.items()}
        self.tracker._peak_mem_snap = copy.deepcopy(current)
        if phase == "backward" and not self.interleaved:  # the next forward: a new iteration
            self.tracker.reset_mod_stats()


def _where(tracker: FSDPMemTracker, total: int) -> str:
    """The innermost FSDP module whose own peak is this peak ("" if none is)."""
    names = [
        stats.mod_fqn
        for stats in tracker.memory_tracking.values()
        if total in stats.local_peak.values()
    ]
    if not names:
        return ""
    name = max(names, key=lambda n: n.count("."))
    inner = name.split(".", 1)[1] if "." in name else ""  # drop the root's class name
    return f"backward of {inner.removeprefix('model.')}" if inner else "root unit"


def _run_config(cfg: RunConfig, sc: Scenario) -> RunConfig:
    """``cfg`` with the precision the plan resolved (auto means bf16 for a GPU even
    though the trace runs on the CPU), and eager blocks: compiling under fake tensors
    would trace the compiler, and the plan of eager blocks bounds compiled ones
    (inductor frees fused temporaries sooner; torchtitan's 8B run peaks 5.4 GiB lower
    compiled)."""
    changes = {"precision.mode": sc.precision, "train.compile": False}
    return with_changes(cfg, {**changes, "parallel.accum_sync": sc.accum_sync})


def fake_trainable(cfg: RunConfig, sc: Scenario) -> tuple[Trainable, RunConfig, FakeTensorMode]:
    """The run's own build ([Note: one builder]) on the fake process group (its mesh
    built outside fake mode), the config it was built from (``_run_config``) and the
    fake mode its parameters belong to, for the steps to run in."""
    mesh = build_mesh(sc.dims, device_type="cpu")
    run_cfg = _run_config(cfg, sc)
    shape = None if cfg.model.hf or cfg.model.factory else sc.model
    unsharded = build_unsharded(run_cfg, vocab_size=sc.vocab_size, device_type="cpu", shape=shape)
    fake = FakeTensorMode()
    with fake, real_meshes():
        run = shard_trainable(unsharded, run_cfg, mesh=mesh, device=CPU, fake=fake)
    return run, run_cfg, fake


def _trace(cfg: RunConfig, sc: Scenario) -> PhaseRecorder:
    """One steady-state step of the run's own build ([Note: one builder]) under fake
    tensors, with the trainer's step function, recorded phase by phase."""
    run, run_cfg, fake = fake_trainable(cfg, sc)
    with fake:
        gloo = sc.device.kind == "cpu"
        if gloo and sc.dims.fsdp_shard > 1:
            model_gloo_buffers(run.model)
        loss_fn = _grads_in_place(run.loss_fn)
        _steady_state(run.model, run.optimizer)
        # two micro-batches hold what any later one holds (the second shows what a
        # no-sync accumulation keeps); more would only make the trace slower
        batches = synthetic_batches(
            run_cfg, dp_world=sc.dims.dp, vocab_size=sc.vocab_size, at_most=2
        )
        tracker = UnitTracker(run.model, run.optimizer)
        tracker.track_inputs(tuple(batches))
        recorder = PhaseRecorder(tracker)
        ring = gloo and sc.cp_attention == "ring"
        experts = sc.experts.layers if sc.experts is not None and sc.dims.ep > 1 else 0
        loads = () if sc.routing == BALANCED else call_loads(sc.routing, layers=experts)
        with tracker, faithful_step(loads=loads), ring_gloo_buffers(active=ring):
            train_step(
                run.model,
                run.optimizer,
                batches,
                loss_fn=loss_fn,
                **step_options(run_cfg),
                foreach=False,
                mark=recorder,
            )
    return recorder


def _grads_in_place(loss_fn: LossFn) -> LossFn:
    """A chunked loss that sums a tied head's gradient as the real run does (see the
    module docstring), also inside context parallelism's slicing wrapper and the router
    loss (in place there: its hooks on the trace's own model call that object)."""
    if isinstance(loss_fn, RouterLoss):
        loss_fn.inner = _grads_in_place(loss_fn.inner)
        return loss_fn
    if isinstance(loss_fn, ContextParallelLoss):
        return dataclasses.replace(loss_fn, inner=_grads_in_place(loss_fn.inner))
    if isinstance(loss_fn, ChunkedLoss):
        return dataclasses.replace(loss_fn, grad_into_weight=True)
    return loss_fn


def _steady_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """AdamW's states exist already, as in every step after the first."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def traced_memory(cfg: RunConfig, sc: Scenario) -> MemoryPlan:
    """Per-rank memory of ``sc`` measured on one fake step (see [Note: traced planning]).

    Starts and destroys its own "fake" process group, so it must run in a process
    without one (the ``fsdpkit plan`` CLI, a test, a script).
    """
    what = sc.source or "the model"
    advice = (
        "Code that reads tensor values (data-dependent control flow, .item(), numpy) "
        "cannot run on fake tensors; plan a config whose model traces, or measure a few "
        "real steps with `fsdpkit train`."
    )
    with fake_world(sc, rank=0, failed=f"tracing one training step of {what}", advice=advice):
        recorder = _trace(cfg, sc)
    return _memory_plan(sc, recorder)


@contextlib.contextmanager
def fake_world(sc: Scenario, *, rank: int, failed: str, advice: str) -> Iterator[None]:
    """A "fake" process group of ``sc``'s world, as ``rank``, for one trace (a process
    holds one at a time, and must have none of its own). A failure inside becomes a
    TraceError saying what ``failed`` and the ``advice``; a UserError passes as it is."""
    if dist.is_initialized():
        raise PlanError(
            "traced planning starts its own fake process group, but one is already "
            "initialized in this process; run the plan outside the training job."
        )
    forget_meshes()  # meshes of process groups this process had before
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=sc.dims.world)
    try:
        yield
    except UserError:
        raise
    except Exception as exc:
        raise TraceError(
            f"{failed} under fake tensors failed ({type(exc).__name__}: {exc}). {advice}"
        ) from exc
    finally:
        dist.destroy_process_group()
        forget_meshes()


def _memory_plan(sc: Scenario, recorder: PhaseRecorder) -> MemoryPlan:
    phase, (total, where, breakdown) = max(recorder.peaks.items(), key=lambda kv: kv[1][0])
    states = model_states(sc)
    host_states = sc.offload and sc.device.kind == "gpu"
    notes: tuple[str, ...] = ()
    if host_states:  # the trace runs on the CPU: take the offloaded states off the device
        for key in ("sharded_params", "gradients", "optimizer_states"):
            total -= breakdown[key]
            breakdown[key] = 0
        notes = (*notes, "CPU offload: sharded params, grads and AdamW states are on the host")
    return MemoryPlan(
        mode="traced",
        peak=PeakPoint(total, phase, where, breakdown),
        phase_peaks={k: v[0] for k, v in recorder.peaks.items()},
        model_states=states,
        host_bytes=sum(states.values()) if host_states else 0,
        notes=notes,
        spread=late_free_spread(sc),
    )
