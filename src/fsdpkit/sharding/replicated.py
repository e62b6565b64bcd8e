"""Modules whose ranks compute different tokens with the same weights: the weights
replicated DTensors, the forward on their local tensors, the gradients summed.

[Note: replicated weights, split tokens]
Under tensor parallelism a mixture-of-experts block's router and routed experts run
on each tp rank's own tokens ([Note: experts under tensor parallelism] in
fsdpkit.sharding.tensor.moe), with every weight whole on every tp rank. Such a weight
is a DTensor ``Replicate()`` over tp (beside ``Shard(0)`` over ep for the experts:
fsdpkit.sharding.experts.parallel); ``LocalParams`` gives the module's forward the
local tensors, taken with ``to_local(grad_placements=...)`` where each ``Replicate``
is declared ``Partial``: the gradient a rank computes from its own tokens is one
term of a sum over the tp ranks. FSDP2 redistributes such a gradient to the
parameter's own placements (an all-reduce over tp) before its reduce-scatter over
the data ranks, as for a sequence-parallel norm's weight. ``Shard`` placements (the
experts' split over ep) stay as they are: each rank's gradient is its own rows'.

The module's forward runs its own code on plain tensors (transformers' routers and
grouped-GEMM kernels, which know nothing of DTensor); its parameters are swapped back
after it, so FSDP2, checkpoints and the optimizer only ever see the DTensors.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import ParallelStyle


def partial_grads(placements: tuple[Any, ...]) -> tuple[Any, ...]:
    """The gradient's placements of a weight whose ranks computed different tokens:
    ``Replicate`` becomes ``Partial``, shards stay ([Note: replicated weights, split
    tokens])."""
    return tuple(Partial() if isinstance(p, Replicate) else p for p in placements)


class LocalParams:
    """Inside: every DTensor parameter of ``module`` (of its submodules too with
    ``recurse``) replaced by its local tensor, its gradient declared ``partial_grads``
    (with autograd through ``to_local``); restored on exit."""

    def __init__(self, module: nn.Module, *, recurse: bool = False) -> None:
        self.owners = list(module.modules()) if recurse else [module]
        self.saved: list[tuple[nn.Module, str, Any]] = []

    def __enter__(self) -> None:
        for owner in self.owners:
            for name, p in list(owner._parameters.items()):
                if isinstance(p, DTensor):
                    self.saved.append((owner, name, p))
                    local = p.to_local(grad_placements=partial_grads(p.placements))
                    owner._parameters[name] = local  # type: ignore[assignment]

    def __exit__(self, *exc: object) -> None:
        for owner, name, p in self.saved:
            owner._parameters[name] = p
        self.saved = []


class ReplicatedTokens(ParallelStyle):
    """A per-token module (a router, a gate) whose tp ranks compute their own tokens:
    its parameters ``Replicate()`` DTensors over the tp mesh, its forward on their
    local tensors with gradients summed over tp ([Note: replicated weights, split
    tokens]). Inputs and outputs are plain tensors, untouched."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for owner in module.modules():
            for name, p in list(owner.named_parameters(recurse=False)):
                dt = DTensor.from_local(p.detach(), device_mesh, [Replicate()], run_check=False)
                owner.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))
        entered: list[LocalParams] = []

        def enter(_module: nn.Module, _args: Any) -> None:
            local = LocalParams(module, recurse=True)
            local.__enter__()
            entered.append(local)

        def leave(_module: nn.Module, _args: Any, _output: Any) -> None:
            entered.pop().__exit__()

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)
        return module
