"""Sequence parallelism inside a block: which blocks take it (the rule the trainer and
the planner share) and how their norms and module inputs are laid out ([Note:
tensor-parallel plans] in fsdpkit.sharding.tensor).

A block takes sequence parallelism when its direct children are its attention
(``self_attn``), its MLP (``mlp``) and norms only (fsdpkit.models.accessors.
is_norm_class), whatever the norms are called or where they sit: Llama's two pre-norms,
Gemma2 / Gemma3's four (pre- and post-attention, pre- and post-feedforward),
Exaone4's post-norms.
Between those children a block only adds, scales and normalizes per token, so the
residual stream can hold seq / tp tokens per rank; every norm runs on its shard, and
the attention's and the MLP's inputs are gathered whole (the row-parallel o / down
reduce-scatter their outputs back: fsdpkit.sharding.tensor). The model must also end
in a final norm ``model.norm`` (run on the shard too). A block with any other child
(a dropout, AltUp, a per-layer embedding) keeps the residual stream whole.

Read in transformers 5.24 for each family the rule admits (the Llama-named ones, and
Gemma, Gemma2, Gemma3, Qwen3, Exaone4, Cohere, Granite, OLMo,
VaultGemma, ...; those of them trained against one process at 5.25 are listed in
docs/parallelism.md): every block calls ``self_attn(hidden_states=...)`` and
``mlp(hidden_states)``; the gather takes the first positional argument or
``hidden_states=`` either way. ``EXCLUDED`` names the families whose model body
changes the residual stream's length between blocks, which a split stream cannot
follow.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from fsdpkit.models.accessors import is_norm_class, output_embeddings
from fsdpkit.sharding.pipeline_parts import StageOutput

ATTENTION, MLP = "self_attn", "mlp"
"""The two children of a block whose inputs sequence parallelism gathers."""

EXCLUDED: dict[str, str] = {
    "gemma4_unified_text": "its body slices the hidden states before its KV-sharing layers",
}
"""transformers ``model_type`` -> why its blocks keep the residual stream whole although
their children match."""


def sequence_parallel_block(block: nn.Module) -> bool:
    """Whether ``block``'s direct children are ``self_attn``, ``mlp`` and norms only."""
    children = dict(block.named_children())
    others = [m for n, m in children.items() if n not in (ATTENTION, MLP)]
    has_both = ATTENTION in children and MLP in children
    return has_both and bool(others) and all(is_norm_class(m) for m in others)


def sequence_parallel_applies(model: nn.Module, *, blocks: list[nn.Module]) -> bool:
    """Whether fsdpkit splits ``model``'s norms and residual stream by sequence under
    tensor parallelism (the trainer's and the planner's rule): every block passes
    ``sequence_parallel_block``, the model ends in ``model.norm`` and its family is
    not ``EXCLUDED``."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    final = getattr(getattr(model, "model", None), "norm", None)
    return (
        bool(blocks)
        and model_type not in EXCLUDED
        and isinstance(final, nn.Module)
        and (is_norm_class(final) or _norm_on_a_later_stage(model, final))
        and all(sequence_parallel_block(b) for b in blocks)
    )


def _norm_on_a_later_stage(model: nn.Module, final: nn.Module) -> bool:
    """A pipeline stage before the last: its final norm is an ``nn.Identity`` and its head
    a ``StageOutput`` ([Note: stage modules]); the last stage holds the real norm, so
    every stage decides as the whole model does."""
    head = output_embeddings(model)
    return isinstance(final, nn.Identity) and isinstance(head, StageOutput)


class GatherSequence(ParallelStyle):
    """A module's input, this rank's sequence shard (a DTensor or a plain local tensor),
    gathered whole as a plain tensor before the module runs: the first positional
    argument, else the ``hidden_states=`` keyword (a transformers attention's), as
    torch's ``PrepareModuleInput`` gathers one; its backward keeps this rank's shard
    of the gradient (which the column-parallel projections reduced over tp). Other
    arguments (masks, positions, cos / sin) are whole already."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(x: Any) -> Any:
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (Shard(1),), run_check=False)
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
