"""``shard``: apply FSDP2 to a model the way it should be done.

Order (as torchtitan): meta-device model -> tensor / context parallelism -> expert
parallelism ([Note: expert parallelism] in fsdpkit.sharding.experts.parallel) -> activation
checkpointing -> compile each block (``train.compile``) -> optional fp32 norm units ->
``fully_shard`` per block (or group of k blocks; under ep a block's routed experts
first, as units of their own), bottom-up -> an untied embedding and head ([Note: edge
units] in fsdpkit.sharding.edges) -> root -> explicit prefetching
(``parallel.forward_prefetch`` / ``backward_prefetch``) -> materialize local shards
(meta models only). The optimizer must be built after this.

[Note: explicit prefetch]
FSDP2 all-gathers a unit in forward when its forward starts, and in backward
prefetches the one unit that ran before it in forward. ``forward_prefetch = k``
makes the root and every block unit issue the all-gathers of the next k block units
(forward order) right after their own; ``backward_prefetch = k > 1`` makes the root
and every unit prefetch the k units backward needs next. A unit already unsharded or
in flight is not gathered twice (FSDP2's ``unshard`` is idempotent). Each unit in
flight holds its all-gather output from the prefetch until its own turn: up to k
extra units of unsharded parameters (the planner counts them). The gain is overlap
of collectives with compute, which needs a separate communication stream (NCCL);
on CPU/gloo the collectives run on the compute thread's critical path.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from fsdpkit.config import ParallelConfig, RunConfig
from fsdpkit.init import Initializer
from fsdpkit.models.accessors import is_norm
from fsdpkit.models.hf.initialize import own_initializer
from fsdpkit.sharding.activations import checkpoint_forward
from fsdpkit.sharding.blocks import choose_blocks
from fsdpkit.sharding.compile import compile_blocks, enable_async_tp
from fsdpkit.sharding.context.attention import apply_context_parallel
from fsdpkit.sharding.edges import edge_modules
from fsdpkit.sharding.experts.parallel import expert_parallel, shard_experts
from fsdpkit.sharding.heads import CP_ATTENTION, heads_cp
from fsdpkit.sharding.materialize import is_meta, materialize
from fsdpkit.sharding.mesh import cp_mesh, fsdp_mesh, tp_mesh
from fsdpkit.sharding.policy import offload_policy, reshard_after_forward, resolve_precision
from fsdpkit.sharding.tensor.plans import tensor_parallel
from fsdpkit.sharding.units import UnitSpec, block_specs, unit_specs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardPlan:
    """What ``shard`` did, for logs and tests."""

    block_class: str | None
    """Class name of the blocks (None when the model has no repeated blocks)."""
    block_reason: str
    """Why these blocks (see [Note: block detection])."""
    blocks: int
    """Blocks found."""
    units: int
    """FSDP block units (``blocks_per_unit`` blocks each, the last maybe fewer)."""
    params_per_unit: int
    """Parameters in the first block unit."""
    root_params: int
    """Parameters left to the root unit (a tied embedding and head, the final norm...)."""
    checkpointed: int
    """Blocks whose activations are recomputed in backward (wholly, or op by op)."""
    precision: str
    """Resolved precision preset."""
    reshard_after_forward: bool | int
    """The strategy's resharding of block units."""
    specs: tuple[UnitSpec, ...] = ()
    """Every unit as built (fsdpkit.sharding.units), root last."""
    checkpoint_mode: str = "none"
    """activations.mode: what a checkpointed block recomputes (full or selective)."""
    compiled: bool = False
    """Whether each block was torch.compile'd (train.compile)."""
    edges: tuple[str, ...] = ()
    """Edge modules in units of their own ([Note: edge units]): "embedding", "norm", "head"."""
    model_parallel: str | None = None
    """The tensor / context parallelism applied before FSDP2 (None: FSDP alone)."""

    def describe(self) -> str:
        if not self.units:
            return (
                f"1 unit (root only, {_m(self.root_params)} params: {self.block_reason}); "
                f"precision {self.precision}"
            )
        per = len(block_specs(self.specs)[0].blocks) if self.specs else 1
        group = f"{self.block_class}" if per == 1 else f"{per} x {self.block_class}"
        edges = f"; {', '.join(self.edges)} in units of their own" if self.edges else ""
        return (
            f"{self.units} x {group} units ({self.block_reason}), {_m(self.params_per_unit)} "
            f"params in the first{edges}, root holds {_m(self.root_params)}; {self._ac()} "
            f"activation checkpointing on {self.checkpointed}/{self.blocks} blocks; precision "
            f"{self.precision}; reshard_after_forward={self.reshard_after_forward}"
            + ("; blocks compiled" if self.compiled else "")
            + (f"; {self.model_parallel}" if self.model_parallel else "")
        )

    def _ac(self) -> str:
        return "selective" if self.checkpoint_mode == "selective" else "full-block"


def _m(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}K"


def _checkpoint(blocks: list[nn.Module], specs: tuple[UnitSpec, ...], cfg: RunConfig) -> int:
    """Activation checkpointing of the blocks the specs name; module names and
    state-dict keys are unchanged. Full checkpointing of eager blocks uses the
    composable API (module hooks); selective checkpointing and compiled blocks call
    ``torch.utils.checkpoint`` inside the block's forward ([Note: where the
    checkpoint sits] in fsdpkit.sharding.activations). Returns how many."""
    chosen = [blocks[b] for s in specs for b, on in zip(s.blocks, s.checkpointed) if on]
    for block in chosen:
        if cfg.train.compile or cfg.activations.mode == "selective":
            checkpoint_forward(block, cfg=cfg.activations)
        else:
            checkpoint(block)
    return len(chosen)


def _shard_norms(
    model: nn.Module, *, mesh: DeviceMesh, raf: bool | int, kw: dict[str, Any]
) -> None:
    """Norm layers as their own fp32 units (``precision.norms_fp32``)."""
    for norm in [m for m in model.modules() if is_norm(m)]:
        fully_shard(norm, mesh=mesh, reshard_after_forward=raf, **kw)


def shard(
    model: nn.Module, cfg: RunConfig, *, mesh: DeviceMesh, init: Initializer | None = None
) -> ShardPlan:
    """Shard ``model`` in place with FSDP2 following ``cfg``'s parallel, precision,
    offload and activations sections; returns the plan it applied.

    A model built under ``torch.device("meta")`` is materialized afterwards with only
    the local shards allocated and initialized by ``init(model)`` when given (e.g.
    loading a Hugging Face directory), else by the model's own init, as ``fsdpkit
    train`` does (``fsdpkit.models.hf.initialize.own_initializer``: a transformers model's
    ``_init_weights``, otherwise fsdpkit's per-parameter init), exactly what
    ``fsdpkit.init_weights`` gives the same model built on the CPU with seed
    ``cfg.train.seed``. Real buffers are kept; see [Note: buffers of meta models].
    """
    if init is None and is_meta(model):
        init = own_initializer(model, seed=cfg.train.seed)
    device_type = mesh.device_type
    precision = resolve_precision(cfg.precision, device_type=device_type)
    choice = choose_blocks(model, class_names=cfg.parallel.block_classes or None)
    blocks = list(choice.blocks)  # the class name is taken before FSDP renames it
    model_parallel = _model_parallel(model, mesh=mesh, blocks=blocks, cfg=cfg.parallel)
    experts = expert_parallel(model, mesh=mesh, capacity=cfg.model.capacity_factor)
    model_parallel = "; ".join(d for d in (model_parallel, experts) if d) or None
    full_mesh, mesh = mesh, fsdp_mesh(mesh)  # FSDP2 shards over the data axes only
    edges = edge_modules(model, blocks=blocks, enabled=cfg.parallel.edge_units)
    fp32_norms = cfg.precision.norms_fp32 and precision.low_precision
    if fp32_norms:  # every norm is an fp32 unit of its own already
        edges.pop("norm", None)
    specs = unit_specs(
        len(blocks), parallel=cfg.parallel, activations=cfg.activations, edges=tuple(edges)
    )
    checkpointed = _checkpoint(blocks, specs, cfg)
    if cfg.train.compile:
        if cfg.parallel.async_tp:
            enable_async_tp(device_type=device_type)
        compile_blocks(blocks)
    offload = offload_policy(enabled=cfg.offload.params, device_type=device_type)
    if fp32_norms:
        kw = {"mp_policy": precision.norm_policy(), "offload_policy": offload}
        _shard_norms(model, mesh=mesh, raf=reshard_after_forward(cfg.parallel), kw=kw)
    mp, off = precision.policy(), offload
    for spec in specs:
        units = _unit_modules(spec, model=model, blocks=blocks, edges=edges)
        raf = spec.reshard_after_forward
        shard_experts(
            units, mesh=full_mesh, reshard_after_forward=raf, mp_policy=mp, offload_policy=off
        )
        fully_shard(units, mesh=mesh, reshard_after_forward=raf, mp_policy=mp, offload_policy=off)
    _set_prefetch(model, [blocks[s.blocks[0]] for s in block_specs(specs)], cfg.parallel)
    if is_meta(model):
        _materialize(model, cfg, device_type=device_type, init=init)
    plan = ShardPlan(
        block_class=choice.class_name,
        block_reason=choice.reason,
        blocks=len(blocks),
        units=len(block_specs(specs)),
        params_per_unit=_numel(blocks[b] for b in block_specs(specs)[0].blocks) if blocks else 0,
        root_params=_numel([model]) - _numel([*blocks, *edges.values()]),
        checkpointed=checkpointed,
        checkpoint_mode=cfg.activations.mode,
        compiled=cfg.train.compile,
        precision=precision.name,
        reshard_after_forward=reshard_after_forward(cfg.parallel),
        specs=specs,
        edges=tuple(edges),
        model_parallel=model_parallel,
    )
    log.info("fsdpkit.shard: %s", plan.describe())
    return plan


def _model_parallel(
    model: nn.Module, *, mesh: DeviceMesh, blocks: list[nn.Module], cfg: ParallelConfig
) -> str | None:
    """Tensor parallelism over the mesh's tp axis, then context parallelism over its cp
    axis, before anything wraps the blocks; what was applied, for the first lines."""
    done = []
    tp, cp_axis = tp_mesh(mesh), cp_mesh(mesh)
    heads = heads_cp(cp=cfg.cp, attention=cfg.cp_attention)
    if tp is not None:
        done.append(tensor_parallel(model, mesh=tp, blocks=blocks, cp=heads).describe(tp.size()))
    if cp_axis is not None:
        layers = apply_context_parallel(model, mesh=cp_axis, attention=cfg.cp_attention)
        how = CP_ATTENTION[cfg.cp_attention]
        done.append(f"context parallel {cp_axis.size()} ({how} in {layers} attention layers)")
    return "; ".join(done) or None


def _unit_modules(
    spec: UnitSpec, *, model: nn.Module, blocks: list[nn.Module], edges: dict[str, nn.Module]
) -> nn.Module | list[nn.Module]:
    """What ``fully_shard`` is applied to for ``spec``."""
    if spec.role == "block":
        return [blocks[b] for b in spec.blocks]
    return model if spec.is_root else edges[spec.role]


def _set_prefetch(model: nn.Module, units: list[nn.Module], cfg: ParallelConfig) -> None:
    """[Note: explicit prefetch]: ``units`` are the block units (one module of each)
    in forward order; the root is ``model``."""
    fwd, bwd = cfg.forward_prefetch, cfg.backward_prefetch
    fsdp: list[FSDPModule] = [u for u in units if isinstance(u, FSDPModule)]
    if not isinstance(model, FSDPModule) or not fsdp:
        return
    if fwd > 0:
        model.set_modules_to_forward_prefetch(fsdp[:fwd])
        for i, unit in enumerate(fsdp):
            unit.set_modules_to_forward_prefetch(fsdp[i + 1 : i + 1 + fwd])
    if bwd > 1:
        model.set_modules_to_backward_prefetch(fsdp[::-1][:bwd])
        for i, unit in enumerate(fsdp):
            unit.set_modules_to_backward_prefetch(fsdp[max(i - bwd, 0) : i][::-1])


def _numel(modules: Iterable[nn.Module]) -> int:
    """Parameters of ``modules``, each tensor once (tied or shared counted once)."""
    seen = {id(p): p.numel() for m in modules for p in m.parameters()}
    return sum(seen.values())


def _materialize(
    model: nn.Module, cfg: RunConfig, *, device_type: str, init: Initializer | None
) -> None:
    device = (
        torch.device(device_type, torch.cuda.current_device())
        if device_type == "cuda"
        else torch.device("cpu")
    )
    param_device = torch.device("cpu") if cfg.offload.params else device
    materialize(
        model, seed=cfg.train.seed, param_device=param_device, buffer_device=device, init=init
    )
