"""The embedding, the final norm and the output head under tensor parallelism: split
by vocabulary (loss parallel) or kept whole, and where the sequence is split and
gathered around the blocks under sequence parallelism ([Note: tensor-parallel plans]
in fsdpkit.sharding.tensor.plans).

The sequence is split at the blocks' input and gathered at the head's: for the
built-in Llama the embedding's output itself is split (its partial sums
reduce-scattered over the sequence); a transformers model's body derives the
attention mask and positions from the embedding output's length, so there the
embedding's output stays whole (its partial sums all-reduced) and the first block's
input is split instead (a local slice, by a pre-hook that a checkpointed block's
recompute does not apply twice). The final norm runs on the sequence shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from fsdpkit.models.accessors import input_embeddings
from fsdpkit.sharding.tensor.rules import edge_pair, vocab_parallel_refusal


def _vocab_parallel(
    model: nn.Module, *, mesh: DeviceMesh, out: Shard | Replicate, into: Shard | Replicate
) -> None:
    """The embedding and head split by vocabulary rows: the embedding's partial rows
    reduced to ``out``, the head's input (laid out ``into``) gathered whole and its
    logits gathered over the vocabulary, which the chunked loss never asks for (it
    reads the local rows: fsdpkit.loss.chunked_ce). A tied pair is one Shard(0)
    parameter, tied again after both are split (on a pipeline's last stage, the head's
    and its ``TiedStageInput``'s)."""
    embedding, head = edge_pair(model)
    holder = input_embeddings(model)  # the embedding, or a last stage's TiedStageInput
    tied = head is not None and getattr(holder, "weight", None) is head.weight
    if embedding is not None:
        parallelize_module(
            embedding, mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=out)
        )
        embedding.register_forward_hook(_waited)
    if head is not None:
        style = ColwiseParallel(input_layouts=into, output_layouts=Replicate())
        parallelize_module(head, mesh, style)
    if tied and embedding is not None:
        head.weight = embedding.weight  # type: ignore[union-attr]
    elif tied:
        holder.weight = head.weight  # type: ignore[union-attr]


def _waited(_module: nn.Module, _args: Any, output: Any) -> Any:
    """[Note: the embedding's reduction, waited]
    RowwiseParallel reduces the embedding's partial sums with an async collective and
    returns its pending result (an ``AsyncCollectiveTensor``, waited on first use).
    Fed as the input of a ``torch.compile``d block, that tensor trained wrong: the
    losses of tp2 x cp2 with compiled blocks drifted from the eager model by 1.7e-4 at
    the second step (tests/distributed/test_model_parallel.py, gloo), exact once the
    result is waited here. A copy of this rank's shard of the embedding output is what
    waiting costs (autograd's own op: the gradient flows through it)."""
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output


def _whole(model: nn.Module, *, mesh: DeviceMesh, out: Shard | Replicate) -> None:
    """Under sequence parallelism, an embedding and head kept whole: the embedding's
    output laid out ``out``; the head gets the whole sequence."""
    embedding, head = edge_pair(model)
    if out != Replicate() and embedding is not None:
        parallelize_module(
            embedding,
            mesh,
            PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=out),
        )
    if head is not None:
        parallelize_module(
            head,
            mesh,
            PrepareModuleInput(
                input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=True
            ),
        )


_SPLIT = "_fsdpkit_sequence_shard"
"""Marks a block input ``_split_sequence`` made."""


def _split_sequence(mesh: DeviceMesh) -> Callable[..., Any]:
    """A forward pre-hook giving a block this rank's sequence shard of its (whole)
    input, the first positional argument or ``hidden_states=``; its backward gathers
    the gradient. A fully checkpointed block runs its own pre-hooks again on the
    inputs it saved, which are split already: those pass."""

    def split(x: Any) -> Any:
        if getattr(x, _SPLIT, False):
            return x
        whole = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
        local = whole.redistribute(placements=(Shard(1),)).to_local()
        setattr(local, _SPLIT, True)
        return local

    def hook(
        _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args:
            return (split(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": split(kwargs["hidden_states"])}

    return hook


def edges(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    sequence_parallel: bool,
    first_block: nn.Module | None = None,
) -> str | None:
    """Parallelize the embedding, the final norm and the head; returns why the
    vocabulary was not split (None: it was). ``first_block``: under sequence
    parallelism, a transformers model's first block, whose input is split instead of
    the embedding's output (see the module note)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    out = Replicate() if first_block is not None else seq
    refusal = vocab_parallel_refusal(model, tp=mesh.size())
    if refusal is None:
        _vocab_parallel(model, mesh=mesh, out=out, into=seq)
    elif sequence_parallel:
        _whole(model, mesh=mesh, out=out)
    if not sequence_parallel:
        return refusal
    embedding, head = edge_pair(model)  # a pipeline stage splits or gathers at its own ends only
    if first_block is not None and embedding is None:  # a later stage of a transformers model
        gather = PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True
        )  # its body reads the sequence's length off the embedding's output: whole, as on stage 0
        entry = input_embeddings(model)
        assert entry is not None  # _edge_pair found it
        parallelize_module(entry, mesh, gather)
    if first_block is not None:
        first_block.register_forward_pre_hook(_split_sequence(mesh), with_kwargs=True)
    if head is not None:  # the final norm on the sequence shard (a plain tensor out of HF)
        norm = SequenceParallel(use_local_output=first_block is not None)
        parallelize_module(model.get_submodule("model.norm"), mesh, norm)
    return refusal
