"""The router loss of a mixture-of-experts model cut into pipeline stages.

[Note: the router loss across stages]
The load-balancing loss ``A = E x sum_e (C_e / N) (S_e / N)`` ([Note: the balance loss
from sums] in fsdpkit.loss.balance) sums every layer's router probabilities ``S``,
top-k assignments ``C`` and rows ``N`` over the global micro-batch: the layers sit on
every stage, and each rank of a stage holds its own tokens. So a stage sends on,
beside its hidden state, a second tensor: the sums so far of this rank's tokens
([2 E + 1], ``routing_sums``), to which each stage adds its own layers'. The last
stage sums them over its ranks (the all-reduce of ``S`` with autograd) and adds
``coef x A`` to the loss it returns. In backward the schedule sends ``dA/dS`` back
beside the hidden state's gradient, so every stage's routers get their share of the
aux loss's gradient, exactly as in one process: the second tensor is the pipeline's
own route for it, with no collective across the stages. Each micro-batch has its own
``A`` (as without pp); the gradient is scaled by 1 / tp as ``RouterLoss`` scales it
([Note: the router loss over the global batch] in fsdpkit.loss.router). Evaluation
sends the hidden state alone and adds nothing.

A transformers family's aux loss is taken in this form where its own
``load_balancing_loss_func`` gives the same value on a probe (Mixtral's, Qwen2-MoE's,
Qwen3-MoE's and OLMoE's in transformers 5.25 are that function); another family is
refused under pp, by name. The step's metrics report ``aux_loss`` (the last stage's,
summed over the pipeline group) and the dispatch's ``moe_dropped`` / ``moe_imbalance``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdpkit.errors import ConfigError
from fsdpkit.loss.balance import aux_of, aux_of_sums, routing_sums
from fsdpkit.loss.dispatch_metrics import DispatchMetrics
from fsdpkit.loss.router import RouterRecorder, RouterSpec, grad_scaled
from fsdpkit.sharding.mesh import pp_mesh, stage_group, tp_mesh


def takes_sums(spec: RouterSpec) -> bool:
    """Whether ``spec``'s aux loss is the one ``routing_sums`` give (the built-in model's
    is; a transformers family's when its function agrees on a probe within 1e-6)."""
    if not spec.gathered or spec.aux_fn is None:
        return True
    g = torch.Generator().manual_seed(0)
    e, k = spec.experts, spec.top_k
    logits = [torch.randn(7, e, generator=g, dtype=torch.float64) for _ in range(3)]
    want = float(spec.aux_fn(tuple(logits), e, k))
    sums = routing_sums(logits, e, k)
    got = float(aux_of(sums[:e], sums[e : 2 * e], sums[2 * e], e))
    return abs(got - want) <= 1e-6 * max(abs(want), 1.0)


def check_stage_router(spec: RouterSpec | None) -> None:
    """Refuse a family whose router loss fsdpkit cannot carry across stages."""
    if spec is not None and spec.coef and not takes_sums(spec):
        raise ConfigError(
            f"parallel.pp: {spec.family}'s router loss (its load_balancing_loss_func) is not "
            "the Switch Transformer form fsdpkit carries across pipeline stages as "
            "per-expert sums ([Note: the router loss across stages]). Use parallel.pp = 1 "
            "for this model, or model.router_aux_loss_coef = 0 to train without it."
        )


class StageRouting:
    """One stage's part of the router loss ([Note: the router loss across stages])."""

    def __init__(
        self, part: nn.Module, *, spec: RouterSpec, group: Any, tp: int, device: torch.device
    ) -> None:
        self.spec = spec
        self.device = device
        self.recorder = RouterRecorder(part, spec=spec)
        self.group = group
        """The stage's ranks (fsdpkit.sharding.mesh.stage_group)."""
        self.tp = tp
        self.aux: list[torch.Tensor] = []
        """This step's ``A`` of each micro-batch (on the last stage)."""

    def sums(self, logits: list[torch.Tensor], received: torch.Tensor | None) -> torch.Tensor:
        """The sums to send on: those ``received`` plus this stage's layers'."""
        e = self.spec.experts
        if logits:
            own = routing_sums(logits, e, self.spec.top_k)
        else:  # a stage of dense blocks only
            own = torch.zeros(2 * e + 1, device=self.device)
        return own if received is None else received + own

    def loss(self, sums: torch.Tensor) -> torch.Tensor:
        """``coef x A`` of the global micro-batch (the last stage's term of the loss)."""
        aux = aux_of_sums(sums, self.spec.experts, group=self.group)
        self.aux.append(aux.detach().float())
        return self.spec.coef * grad_scaled(aux, 1 / self.tp)


class PipelineRouting:
    """A rank's stages' routing, and the step's metrics ([Note: the router loss across
    stages])."""

    def __init__(
        self, stages: list[StageRouting], *, view: nn.Module, group: Any, micro_batches: int
    ) -> None:
        self.stages = stages
        self.group = group
        """The pipeline group (the aux loss of its last stage reaches every rank)."""
        self.micro_batches = micro_batches
        self.dispatches = DispatchMetrics(view)

    def step_metrics(self) -> dict[str, Any]:
        """``aux_loss`` (the mean of the step's micro-batches) and the dispatch's
        metrics: collectives every rank calls once a step. The first step's schedule
        also runs each stage once on placeholder inputs, to learn what it sends (torch's
        metadata inference): only the step's own last ``micro_batches`` count."""
        auxes = [a for s in self.stages for a in s.aux][-self.micro_batches :]
        for s in self.stages:
            s.aux.clear()
        device = next(self.dispatches.model.parameters()).device
        mean = torch.stack(auxes).mean() if auxes else torch.zeros((), device=device)
        dist.all_reduce(mean, group=self.group)
        return {"aux_loss": float(mean)} | self.dispatches.step_metrics()


def stage_routing(
    stages: list[Any],
    *,
    spec: RouterSpec,
    mesh: DeviceMesh,
    view: nn.Module,
    device: torch.device,
    micro_batches: int,
) -> PipelineRouting:
    """Each of this rank's stages (``StageModule``s) given its part of the router loss,
    summed over the stage's ranks; the whole, for the step's metrics."""
    group = stage_group(mesh)
    tp_axis = tp_mesh(mesh)
    tp = tp_axis.size() if tp_axis is not None else 1
    for stage in stages:
        stage.routing = StageRouting(stage.part, spec=spec, group=group, tp=tp, device=device)
    pp = pp_mesh(mesh)
    assert pp is not None
    routings = [s.routing for s in stages]
    return PipelineRouting(routings, view=view, group=pp.get_group(), micro_batches=micro_batches)
