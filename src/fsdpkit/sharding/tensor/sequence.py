"""Sequence parallelism inside a block, applied: the norms run on each rank's sequence
shard and the attention's and MLP's inputs are gathered whole ([Note: sequence
parallel blocks] in fsdpkit.sharding.tensor.rules says which blocks take it).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from fsdpkit.sharding.tensor.rules import ATTENTION, MLP


class GatherSequence(ParallelStyle):
    """A module's input, this rank's sequence shard (a DTensor or a plain local tensor),
    gathered whole as a plain tensor before the module runs: the first positional
    argument, else the ``hidden_states=`` keyword (a transformers attention's), as
    torch's ``PrepareModuleInput`` gathers one; its backward keeps this rank's shard
    of the gradient (which the column-parallel projections reduced over tp). Other
    arguments (masks, positions, cos / sin) are whole already. ``dim``: the sequence's
    (1, of [batch, seq, hidden]; 0 for the tokens of a mixture-of-experts block's
    shared experts, [tokens, hidden], fsdpkit.sharding.tensor.moe)."""

    def __init__(self, *, dim: int = 1) -> None:
        super().__init__()
        self.dim = dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(x: Any) -> Any:
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (Shard(self.dim),), run_check=False)
            return x.redistribute(placements=(Replicate(),)).to_local()

        def hook(
            _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            if args:
                return (gather(args[0]), *args[1:]), kwargs
            if "hidden_states" not in kwargs:
                raise TypeError(
                    f"sequence parallelism: {type(_module).__name__} was called without "
                    "a positional input or hidden_states=, so fsdpkit cannot gather its "
                    "sequence shard. Use parallel.tp = 1 for this model."
                )
            return args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def sequence_parallel_styles(block: nn.Module) -> dict[str, ParallelStyle]:
    """A sequence-parallel block's styles: each norm on the sequence shard (its
    weight a replicated DTensor whose gradient is reduced over tp; a plain tensor out,
    for the residual adds), the attention's and the MLP's inputs gathered."""
    norms = [n for n, m in block.named_children() if n not in (ATTENTION, MLP)]
    styles: dict[str, ParallelStyle] = {n: SequenceParallel(use_local_output=True) for n in norms}
    return {**styles, ATTENTION: GatherSequence(), MLP: GatherSequence()}
