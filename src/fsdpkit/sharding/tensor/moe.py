"""Mixture-of-experts blocks under tensor parallelism: how the children of a block's
sparse MLP split over the tp ranks.

[Note: experts under tensor parallelism]
A block whose ``mlp`` holds routed experts (fsdpkit.sharding.tensor.rules.moe_mlp)
keeps its attention split by heads ([Note: tensor-parallel plans] in
fsdpkit.sharding.tensor.plans); its MLP, which computes each token on its own, runs
on each tp rank's own tokens:

- under sequence parallelism the MLP's input is the rank's sequence shard already
  (not gathered, as a dense MLP's is) and so is its output; without it the rank takes
  its shard of the whole hidden states (``SplitTokens``) and the output is
  all-gathered back;
- the router, and any other per-token module with weights (Qwen2-MoE's shared-expert
  gate), keeps its weights whole on every tp rank with their gradients summed over tp
  (``ReplicatedTokens``, [Note: replicated weights, split tokens] in
  fsdpkit.sharding.replicated);
- the routed experts likewise (fsdpkit.sharding.experts.parallel): each tp rank
  dispatches its own tokens, over the ep ranks of its tp coordinate where ep > 1 (ep
  and tp are separate mesh axes, [Note: parallel dimensions]);
- shared experts (a SwiGLU of ``gate_proj`` / ``up_proj`` / ``down_proj`` linears)
  split as a dense MLP: the tp group's tokens gathered (``GatherSequence`` over dim 0
  of the flattened [tokens, hidden]), gate / up column-parallel, down row-parallel and
  reduce-scattered back to each rank's tokens (in the order they were gathered).

Why the tokens rather than each expert's matmuls (torchtitan's tensor parallelism
inside the experts): transformers fuse gate and up into one [E, 2f, d] tensor whose
halves a contiguous split over tp would pair wrongly (a checkpoint must keep that
tensor's layout), and splitting the tokens does 1/tp of the experts' FLOPs and sends
1/tp of the rows through the ep all-to-alls with no activation gathered. The cost:
each tp rank holds its ep rank's experts whole (FSDP2 still shards them over the
data ranks) and their gradients are all-reduced over tp before FSDP2's reduce-scatter.
The router's loss sees each token once: the tp ranks' tokens differ
(fsdpkit.loss.router scales its gradient for the tp copies of the loss).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from fsdpkit.models.experts import ROUTED_COMPONENT
from fsdpkit.sharding.replicated import ReplicatedTokens
from fsdpkit.sharding.tensor.rules import MLP, moe_mlp
from fsdpkit.sharding.tensor.sequence import GatherSequence

SWIGLU = ("gate_proj", "up_proj", "down_proj")
"""The linears of a shared expert that tp splits as a dense MLP."""


class SplitTokens(ParallelStyle):
    """Without sequence parallelism: the MLP's input (whole hidden states [batch, seq,
    hidden], the same on every tp rank) cut to this rank's sequence shard before it
    runs, and its output gathered whole after ([Note: experts under tensor
    parallelism]). In backward the shards' gradients are gathered (each rank's tokens'
    gradient comes from that rank alone) and the whole output's gradient is cut."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def split(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            whole = DTensor.from_local(args[0], device_mesh, (Replicate(),), run_check=False)
            return (whole.redistribute(placements=(Shard(1),)).to_local().contiguous(), *args[1:])

        def gather(_module: nn.Module, _args: Any, output: Any) -> Any:
            part = DTensor.from_local(output, device_mesh, (Shard(1),), run_check=False)
            return part.redistribute(placements=(Replicate(),)).to_local()

        module.register_forward_pre_hook(split)
        module.register_forward_hook(gather)
        return module


def is_swiglu(module: nn.Module) -> bool:
    """Whether ``module`` is a plain SwiGLU: linears ``gate_proj``, ``up_proj`` and
    ``down_proj`` holding all its parameters."""
    linears = [module._modules.get(n) for n in SWIGLU]
    if not all(type(m) is nn.Linear for m in linears):
        return False
    own = sum(p.numel() for m in linears if m is not None for p in m.parameters())
    return own == sum(p.numel() for p in module.parameters())


def moe_styles(block: nn.Module, *, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The styles of a mixture-of-experts block's MLP and its children but the routed
    experts ([Note: experts under tensor parallelism]); {} for a dense block."""
    mlp = moe_mlp(block)
    if mlp is None:
        return {}
    styles: dict[str, ParallelStyle] = {} if sequence_parallel else {MLP: SplitTokens()}
    for name, child in mlp.named_children():
        path = f"{MLP}.{name}"
        if name == ROUTED_COMPONENT or not any(True for _ in child.parameters()):
            continue
        if is_swiglu(child):
            styles[path] = GatherSequence(dim=0)
            styles[f"{path}.gate_proj"] = ColwiseParallel()
            styles[f"{path}.up_proj"] = ColwiseParallel()
            styles[f"{path}.down_proj"] = RowwiseParallel(output_layouts=Shard(0))
        else:
            styles[path] = ReplicatedTokens()
    return styles


def shared_linears(block: nn.Module) -> int:
    """Linears of the block's shared experts split over tp (for the run's first lines)."""
    mlp = moe_mlp(block)
    if mlp is None:
        return 0
    return sum(
        len(SWIGLU) for n, c in mlp.named_children() if n != ROUTED_COMPONENT and is_swiglu(c)
    )
