"""Expert parallelism: the routed experts of every block split over the mesh's ep axis,
tokens dispatched to them (fsdpkit.sharding.experts.dispatch), the experts FSDP-sharded over
the data ranks that remain.

[Note: expert parallelism]
One rule for the built-in MoE model and transformers' families: a routed experts
module is a module named ``experts`` (fsdpkit.models.experts) holding its experts
fused along dim 0 of every parameter (``gate_up_proj`` [E, 2f, d], ``down_proj`` [E,
d, f], biases [E, ...]) with transformers' interface. ``expert_parallel`` (after
tp / cp, before activation checkpointing, compile and FSDP, [Note: parallel
dimensions]):

- makes each such parameter a DTensor ``Shard(0)`` on the ep axis (each rank keeps the
  rows of its E / ep experts; DCP sees the whole [E, ...] tensor under its unchanged
  name, so a checkpoint reshards to and from any ep and world size), and sets the
  module's ``num_experts`` to its local count, as transformers' own expert-parallel
  kernels read it; under tp also ``Replicate()`` on the tp axis, each tp rank
  dispatching its own tokens ([Note: experts under tensor parallelism] in
  fsdpkit.sharding.tensor.moe), also without ep;
- installs ``ExpertDispatch`` as the module's forward ([Note: token dispatch]).

``shard_experts`` then makes each experts module an FSDP unit of its own, before its
block's: over the data axes without ep (``efsdp``, cp folded in, replicated over
``replicate``: fsdpkit.sharding.mesh.expert_fsdp_mesh), the experts' dim 1 as the
FSDP dim where dim 0 (the local experts) does not split evenly over it (torchtitan's
rule), its gradients summed and divided by every data rank (``set_gradient_divide_
factor``): an expert's gradient already sums the rows of all ep ranks, so dividing by
the efsdp ranks alone would leave it ep times too large. The sum is forced (SUM and a
division) because gloo has no pre-multiplied sum; not over a shard axis of one rank
(ep = the shard group), which FSDP2 2.13 does not reduce but divides by the factor, and
then, forced, divided a second time (ep4 on 4 ranks read grad norms 2e-3 off).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdpkit.config import RunConfig
from fsdpkit.config.dims import MeshAxis
from fsdpkit.models.errors import ModelError
from fsdpkit.models.experts import ROUTED_COMPONENT, expert_field, experts_of
from fsdpkit.models.hf.directory import read_hf_dir
from fsdpkit.models.presets import MOE_OVERRIDES, preset
from fsdpkit.sharding.experts.dispatch import ExpertDispatch
from fsdpkit.sharding.mesh import ep_mesh, expert_fsdp_mesh, experts_mesh, fsdp_mesh, tp_mesh


class ExpertParallelError(ModelError):
    """The model cannot be split over ``parallel.ep`` ranks."""


def routed_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every routed experts module: named ``experts``, holding
    parameters of its own ([Note: expert parallelism])."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if name.rsplit(".", 1)[-1] == ROUTED_COMPONENT
        and any(True for _ in m.parameters(recurse=False))
    ]


def config_experts(cfg: RunConfig) -> int | None:
    """The routed experts per block of the configured model, from the config alone
    (None: a dense model; a factory model is checked when built)."""
    m = cfg.model
    if m.hf:
        found = expert_field(read_hf_dir(m.hf).config)
        return found[1] if found else None
    overrides = {f: getattr(m, k) for k, f in MOE_OVERRIDES.items() if getattr(m, k)}
    try:
        return getattr(preset(m.preset, **overrides), "n_experts", None)
    except ValueError:
        return None  # the model's build names the bad preset


def check_layout(cfg: RunConfig) -> None:
    """Refuse ``parallel.ep`` / ``model.capacity_factor`` where the configured model
    cannot take them, from the config alone (the launcher runs this before any process
    starts)."""
    p, m = cfg.parallel, cfg.model
    if (p.ep == 1 and m.capacity_factor is None) or m.factory:
        return
    check_count(config_experts(cfg), ep=p.ep, capacity=m.capacity_factor, what=_what(cfg))


def _what(cfg: RunConfig) -> str:
    return f"model.hf = {cfg.model.hf}" if cfg.model.hf else f"model.preset = {cfg.model.preset}"


def check_count(experts: int | None, *, ep: int, capacity: float | None, what: str) -> None:
    """The refusals of expert parallelism and capacity by the model's expert count."""
    if capacity is not None and capacity <= 0:
        raise ExpertParallelError(
            f"model.capacity_factor = {capacity} must be > 0 (1.0 = each expert takes "
            "its balanced share of a rank's assignments); leave it empty for no capacity."
        )
    if experts is None:
        key = "parallel.ep" if ep > 1 else "model.capacity_factor"
        raise ExpertParallelError(
            f"{key} is set but {what} is a dense model: it routes no experts (no expert "
            "count in its config). Expert parallelism and capacity apply to "
            "mixture-of-experts models (the moe-* / qwen3-* presets, Mixtral, Qwen-MoE, "
            f"OLMoE, ...). Remove {key}, or choose a mixture-of-experts model."
        )
    if experts % ep:
        raise ExpertParallelError(
            f"parallel.ep = {ep} does not divide the {experts} routed experts of {what}: "
            "each expert-parallel rank holds an equal share of every block's experts. "
            f"Choose an ep that divides {experts}."
        )


def check_model(model: nn.Module, *, ep: int, capacity: float | None) -> None:
    """The built model against ``ep`` and the capacity: an MoE model whose expert count
    ep divides and whose experts modules have the fused layout."""
    found = experts_of(model)
    what = type(model).__name__
    check_count(found.count if found else None, ep=ep, capacity=capacity, what=what)
    assert found is not None
    for name, module in routed_modules(model):
        bad = [n for n, p in module.named_parameters(recurse=False) if p.shape[0] != found.count]
        if bad:
            raise ExpertParallelError(
                f"{name} holds {', '.join(bad)} whose dim 0 is not its {found.count} "
                f"experts: fsdpkit splits and dispatches fused experts modules only "
                "(transformers >= 5's layout, [experts, ...] tensors). Remove parallel.ep "
                "and model.capacity_factor for this model."
            )


def expert_parallel(model: nn.Module, *, mesh: DeviceMesh, capacity: float | None) -> str | None:
    """Split every routed experts module over ``mesh``'s ep axis (replicated over its tp
    axis) and install the token dispatch (also without ep where a capacity is set or
    under tp), [Note: expert parallelism]; what was applied, for the run's first lines
    (None: nothing)."""
    ep, tp = ep_mesh(mesh), tp_mesh(mesh)
    modules = routed_modules(model)
    found = experts_of(model)
    if (ep is None and tp is None and not capacity) or not modules or found is None:
        return None
    layout = experts_mesh(mesh)
    for _, module in modules:
        if layout is not None:
            _split(module, mesh=layout, experts=found.count)
        module.expert_dispatch = ExpertDispatch(  # type: ignore[assignment]
            module,
            experts=found.count,
            group=ep.get_group() if ep is not None else None,
            capacity_factor=capacity,
        )
        module.forward = types.MethodType(_dispatched, module)  # type: ignore[method-assign]
        if capacity and hasattr(module, "_is_expert_parallel"):
            module._is_expert_parallel = True  # type: ignore[assignment]  # masks dropped rows
    return _describe(found.count, ep=ep, tp=tp, capacity=capacity, layers=len(modules))


def _describe(
    experts: int,
    *,
    ep: DeviceMesh | None,
    tp: DeviceMesh | None,
    capacity: float | None,
    layers: int,
) -> str | None:
    cap = f", capacity factor {capacity:g}" if capacity else ""
    over_tp = f", whole on each of {tp.size()} tp ranks, which route their own tokens" if tp else ""
    if ep is None:
        if not capacity:
            return None  # the tp plan says it ([Note: experts under tensor parallelism])
        return f"experts dispatched with capacity ({capacity:g}) in {layers} layers"
    per = experts // ep.size()
    return f"expert parallel {ep.size()} ({per} of {experts} experts per rank{over_tp}{cap})"


def _dispatched(self: nn.Module, *args: Any) -> torch.Tensor:
    return self.expert_dispatch(*args)  # type: ignore[operator]


def _split(module: nn.Module, *, mesh: DeviceMesh, experts: int) -> None:
    """Each parameter a DTensor over ``mesh`` (fsdpkit.sharding.mesh.experts_mesh):
    Shard(0) on its ep axis from this rank's rows, Replicate() on its tp axis (every
    rank built the same full tensor, or a meta one: no communication)."""
    names = tuple(mesh.mesh_dim_names or ())
    ep = MeshAxis.EP in names
    rank = mesh.get_local_rank(MeshAxis.EP.value) if ep else 0
    size = mesh.size(names.index(MeshAxis.EP)) if ep else 1
    placements = [Shard(0) if n == MeshAxis.EP else Replicate() for n in names]
    for name, p in list(module.named_parameters(recurse=False)):
        local = p.detach().chunk(size, dim=0)[rank]
        dt = DTensor.from_local(local, mesh, placements, run_check=False)
        module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))
    if ep and hasattr(module, "num_experts"):
        module.num_experts = experts // size  # type: ignore[assignment]


def shard_experts(
    units: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh,
    reshard_after_forward: bool | int,
    **policies: Any,
) -> None:
    """Under expert parallelism, each routed experts module inside ``units`` an FSDP
    unit of its own over the data axes without ep ([Note: expert parallelism]);
    nothing without an ep axis. Call right before ``fully_shard(units)``."""
    ep = ep_mesh(mesh)
    if ep is None:
        return
    experts_mesh = expert_fsdp_mesh(mesh)
    divide = fsdp_mesh(mesh).size()
    raf = reshard_after_forward if isinstance(reshard_after_forward, bool) else True
    for unit in units if isinstance(units, list) else [units]:
        for _, module in routed_modules(unit):
            if isinstance(module, FSDPModule):  # a block's, met again from the root
                continue
            local = next(module.parameters()).to_local().shape[0]  # type: ignore[attr-defined]
            dim = 0 if local % experts_mesh.size() == 0 else 1
            fully_shard(
                module,
                mesh=experts_mesh,
                reshard_after_forward=raf,
                shard_placement_fn=lambda _p, d=dim: Shard(d),  # type: ignore[misc]
                **policies,
            )
            module.set_gradient_divide_factor(float(divide))  # type: ignore[operator]
            if experts_mesh.size(-1) > 1:  # FSDP2 divides a 1-rank shard itself, and again
                module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
