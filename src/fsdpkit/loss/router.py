"""The router's auxiliary loss of a mixture-of-experts model, as its family defines it.

[Note: the router loss over the global batch]
transformers' MoE causal LMs (Mixtral, Qwen2/3-MoE, OLMoE, ...) add
``router_aux_loss_coef x load_balancing_loss_func(router_logits, experts, top_k)`` to
the LM loss when ``output_router_logits`` is set. That loss is not a mean over tokens:
it is ``experts x sum_e f_e P_e`` with ``f_e`` the share of top-k assignments and
``P_e`` the mean router probability of expert ``e`` over every token of the batch, so
averaging it over ranks is not the one-process loss. ``RouterLoss``:

- records each router's logits during the loss's forward, through the recorder the
  family itself declares (``_can_record_outputs["router_logits"]``: a module class and
  the index of its output), only while the loss runs (a checkpointed block's recompute
  in backward records nothing);
- gathers them from every data rank (``torch.distributed.nn.all_gather``: autograd
  sends each rank's gradient back to its own logits) and calls the family's own
  ``load_balancing_loss_func`` on the whole micro-batch, so every rank holds the same
  aux loss ``A`` of the global micro-batch;
- adds ``coef x A`` to each rank's LM loss. The gather's backward sums the ranks'
  identical gradients (x world) and FSDP's mean over ranks divides by the world again:
  the parameters get exactly ``d(coef x A)/d(theta)``, as one process training the
  global batch. Accumulation divides it by the micro-batch count like the LM loss (one
  aux loss per micro-batch, as transformers' Trainer does with accumulation).

The gather spans ``group`` (the whole world, or one pipeline stage's ranks), every
rank of which holds its own tokens: data, context- and expert-parallel ranks, and
under ``parallel.tp`` the tp ranks too, which route their own tokens ([Note: experts
under tensor parallelism] in fsdpkit.sharding.tensor.moe). FSDP averages gradients
over the data and context ranks only, and every tp rank adds the same aux loss (the
LM loss too is the same on the tp ranks of a data rank): so the aux loss's gradient
is scaled by 1 / tp (its value is not), and the parameters get ``d(coef x A)/d(theta)``
again. Evaluation reports the LM loss alone.

The built-in MoE model (fsdpkit.models.moe) computes the same loss from per-expert
sums all-reduced over the ranks instead of gathered logits ([Note: the balance loss
from sums] in fsdpkit.loss.balance): a few numbers per layer whatever the world size.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdpkit.loss.balance import balance_loss
from fsdpkit.loss.contract import LossFn
from fsdpkit.loss.dispatch_metrics import DispatchMetrics
from fsdpkit.models.experts import expert_field
from fsdpkit.models.moe import MoE, MoEConfig, TopKRouter
from fsdpkit.pretrained import is_hf_model


@dataclass(frozen=True)
class RouterSpec:
    """How a model routes, read from the model itself."""

    family: str
    recorder: type[nn.Module]
    """The module class whose output holds the router logits."""
    index: int
    """Which element of that output."""
    aux_fn: Callable[..., Any] | None
    """The family's ``load_balancing_loss_func`` (None: it defines no aux loss)."""
    experts: int
    top_k: int
    coef: float
    gathered: bool = True
    """True: ``aux_fn`` (the family's) runs on every data rank's gathered logits; False:
    ``aux_fn`` is ``balance_loss`` on this rank's logits (the built-in MoE model)."""


def _modeling_module(model: nn.Module) -> Any:
    for cls in type(model).__mro__:
        if cls.__module__.startswith("transformers.models."):
            return sys.modules[cls.__module__]
    return None


def _first(obj: Any, names: tuple[str, ...]) -> Any:
    for name in names:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return None


def router_spec(model: nn.Module, *, coef: float | None = None) -> RouterSpec | None:
    """The model's routing, when it is a transformers MoE model that records router
    logits, or the built-in MoE model (None otherwise). ``coef``: overrides the config's
    ``router_aux_loss_coef``."""
    if isinstance(model, MoE):
        c = model.config
        return RouterSpec(
            family=MoEConfig.model_type,
            recorder=TopKRouter,
            index=0,
            aux_fn=balance_loss,
            experts=c.n_experts,
            top_k=c.top_k,
            coef=float(c.router_aux_loss_coef if coef is None else coef),
            gathered=False,
        )
    if not is_hf_model(model):
        return None
    recorders = getattr(model, "_can_record_outputs", None) or {}
    recorder = recorders.get("router_logits")
    target = getattr(recorder, "target_class", None)
    if target is None:
        return None
    config = model.config  # type: ignore[union-attr]
    module = _modeling_module(model)
    field = expert_field(config)
    experts = _first(model, ("num_experts",)) or (field[1] if field else None)
    top_k = _first(model, ("num_experts_per_tok",)) or _first(config, ("num_experts_per_tok",))
    family_coef = _first(model, ("router_aux_loss_coef",))
    if family_coef is None:
        family_coef = _first(config, ("router_aux_loss_coef",)) or 0.0
    return RouterSpec(
        family=str(getattr(config, "model_type", "?")),
        recorder=target,
        index=int(getattr(recorder, "index", 0) or 0),
        aux_fn=getattr(module, "load_balancing_loss_func", None),
        experts=int(experts or 0),
        top_k=int(top_k or 0),
        coef=float(family_coef if coef is None else coef),
    )


def describe(spec: RouterSpec, *, capacity: float | None = None) -> str:
    """For the run's first lines; ``capacity``: model.capacity_factor."""
    if spec.aux_fn is None:
        return (
            f"mixture of experts ({spec.family}: {spec.experts} experts, top {spec.top_k}): "
            "the family defines no router loss; none is added"
        )
    state = "added to the loss" if spec.coef else "off (coefficient 0)"
    return (
        f"mixture of experts ({spec.family}: {spec.experts} experts, top {spec.top_k}): "
        f"router load-balancing loss x {spec.coef:g} {state}, over each global micro-batch "
        f"({_coef_source(spec)}); {_capacity(capacity)}"
    )


def _coef_source(spec: RouterSpec) -> str:
    own = "the preset's" if not spec.gathered else "config.json's"
    return f"model.router_aux_loss_coef overrides {own}"


def _capacity(capacity: float | None) -> str:
    if not capacity:
        return "no capacity: no token dropped"
    return (
        f"capacity factor {capacity:g}: assignments past an expert's capacity are dropped "
        "and counted (moe_dropped)"
    )


def _gathered(logits: torch.Tensor, *, group: Any = None) -> torch.Tensor:
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return logits
    from torch.distributed.nn import all_gather

    with warnings.catch_warnings():  # deprecated in name; its successor has no gloo backward
        warnings.simplefilter("ignore", FutureWarning)
        return torch.cat(all_gather(logits.contiguous(), group=group or dist.group.WORLD), dim=0)


class _GradScale(torch.autograd.Function):
    """The identity, its gradient times ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def grad_scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` whose gradient is multiplied by ``scale`` (``x`` itself at 1)."""
    return x if scale == 1 else _GradScale.apply(x, scale)


class RouterRecorder:
    """Each router's logits (``spec.recorder``'s output ``spec.index``) in ``model``,
    kept while ``recording`` (a checkpointed block's recompute in backward records
    nothing)."""

    def __init__(self, model: nn.Module, *, spec: RouterSpec) -> None:
        self.spec = spec
        self._recording: list[torch.Tensor] | None = None
        for module in model.modules():
            if isinstance(module, spec.recorder):
                module.register_forward_hook(self._record)

    def _record(self, _module: nn.Module, _args: Any, output: Any) -> None:
        if self._recording is not None:
            value = output[self.spec.index] if isinstance(output, tuple | list) else output
            self._recording.append(value)

    @contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        """The logits of the routers that run inside, in forward order."""
        self._recording = []
        try:
            yield self._recording
        finally:
            self._recording = None


class RouterLoss:
    """A ``LossFn`` that adds the router's aux loss to ``inner`` ([Note: the router loss
    over the global batch]); ``step_metrics`` reports it with the experts' load."""

    def __init__(
        self, inner: LossFn, *, model: nn.Module, spec: RouterSpec, group: Any = None, tp: int = 1
    ) -> None:
        self.inner = inner
        self.spec = spec
        self.group = group
        """The ranks whose tokens make the global micro-batch (None: every rank)."""
        self.tp = tp
        """Tensor-parallel ranks, each adding the same aux loss (its gradient / tp)."""
        self.recorder = RouterRecorder(model, spec=spec)
        self._stats: list[torch.Tensor] = []
        self.dispatches = DispatchMetrics(model)

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if not model.training:
            return self.inner(model, batch)
        with self.recorder.recording() as logits:
            loss = self.inner(model, batch)
        if not logits or self.spec.aux_fn is None:
            return loss
        aux, load = self._aux(tuple(x.reshape(-1, x.shape[-1]) for x in logits))
        self._stats.append(torch.cat([aux.detach().float().reshape(1), load.reshape(-1)]))
        return loss + self.spec.coef * grad_scaled(aux, 1 / self.tp) if self.spec.coef else loss

    def _aux(self, logits: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The aux loss of the global micro-batch and each layer's expert shares."""
        assert self.spec.aux_fn is not None
        experts, k = self.spec.experts, self.spec.top_k
        if not self.spec.gathered:
            aux, load = self.spec.aux_fn(logits, experts, k, group=self.group)
            return aux, load.detach()
        gathered = tuple(_gathered(x, group=self.group) for x in logits)
        return self.spec.aux_fn(gathered, experts, k), self._load(gathered)

    def _load(self, logits: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Per layer, each expert's share of the top-k assignments (detached)."""
        with torch.no_grad():
            shares = []
            for layer in logits:
                chosen = torch.topk(layer.float(), self.spec.top_k, dim=-1).indices.reshape(-1)
                ones = torch.ones_like(chosen, dtype=torch.float32)  # not bincount: its size
                counts = ones.new_zeros(self.spec.experts).index_add_(0, chosen, ones)  # is data's
                shares.append(counts / counts.sum().clamp(min=1))
            return torch.cat(shares)

    def step_metrics(self) -> dict[str, Any]:
        """The step's mean aux loss and the smallest and largest expert share of the
        routed tokens (x experts: 1.0 = balanced), over all layers and per layer.
        Every rank holds the same values (from the gathered logits or the all-reduced
        sums). With a capacity (fsdpkit.sharding.experts.dispatch) also the share of
        assignments dropped over the global batch, ``moe_dropped``: a collective."""
        dropped = self.dispatches.step_metrics()
        if not self._stats:
            return dropped
        mean = torch.stack(self._stats).mean(0)
        self._stats.clear()
        layers = mean[1:].reshape(-1, self.spec.experts) * self.spec.experts
        low, high = layers.min(1).values, layers.max(1).values
        return {
            "aux_loss": float(mean[0]),
            "expert_load_min": float(low.min()),
            "expert_load_max": float(high.max()),
            "expert_load_min_by_layer": [round(float(v), 4) for v in low],
            "expert_load_max_by_layer": [round(float(v), 4) for v in high],
        } | dropped


def with_router_loss(
    loss_fn: LossFn, *, model: nn.Module, coef: float | None, group: Any = None, tp: int = 1
) -> LossFn:
    """``loss_fn`` with the model's router loss when it is a MoE model (else itself);
    ``group`` and ``tp``: as ``RouterLoss`` takes them."""
    spec = router_spec(model, coef=coef)
    if spec is None:
        return loss_fn
    return RouterLoss(loss_fn, model=model, spec=spec, group=group, tp=tp)
