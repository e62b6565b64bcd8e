"""The units the planner plans: those ``shard()`` builds, read off the model on meta.

``model_layout`` builds the run's model on the meta device (no memory), asks
``fsdpkit.sharding.choose_blocks`` which blocks it has (``parallel.block_classes``
included) and records every parameter's shape per block and for the root.
``units`` then groups the blocks with ``fsdpkit.sharding.unit_specs`` — the function
``shard()`` applies — and sizes each unit's shard with FSDP2's padding: every
parameter is sharded on dim 0, padded up to a multiple of the shard group, so a
rank's shard of a (rows, cols) parameter is ceil(rows / S) * cols elements and the
all-gathered copy ceil(rows / S) * S * cols.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fsdpkit.config import ActivationsConfig, ParallelConfig
from fsdpkit.models.llama import DecoderLayer, Llama, LlamaConfig
from fsdpkit.sharding import choose_blocks, unit_specs

Shape = tuple[int, int]
"""(rows, cols) of a parameter as FSDP2 shards it: dim 0, and the rest flattened."""


@dataclass(frozen=True)
class ModelLayout:
    """Parameter shapes of a model, split as ``shard()`` splits it."""

    block_class: str | None
    block_reason: str
    blocks: tuple[tuple[Shape, ...], ...]
    """Per block in forward order, the shapes of its parameters."""
    root: tuple[Shape, ...]
    """Parameters in no block (embedding, final norm, an untied head...)."""
    decoder_blocks: bool
    """Whether the blocks are fsdpkit's Llama decoder layers, whose activations the
    analytic model ([Note: block event model]) knows op by op."""


@dataclass(frozen=True)
class Unit:
    """One FSDP unit's parameters (elements; per rank where noted) and its policy."""

    name: str
    blocks: tuple[int, ...]
    """Indices of the blocks in the unit (empty for the root)."""
    numel: int
    """Parameters, unpadded."""
    sharded: int
    """Elements of this rank's padded shard."""
    gathered: int
    """Elements of the padded all-gathered copy (= sharded * S)."""
    matrix_sharded: int
    """Elements of this rank's shard of the 2-D parameters (AdamW's weight-decay group,
    whose foreach step allocates one temporary of this size)."""
    reshard_after_forward: bool | int
    """As ``shard()`` passes it to ``fully_shard`` (fsdpkit.sharding.units)."""
    checkpointed: tuple[bool, ...]
    """Per block: recomputed in backward."""


def _shape(p: torch.Tensor) -> Shape:
    return (p.shape[0], math.prod(p.shape[1:])) if p.dim() else (1, 1)


def layout_of(model: nn.Module, *, class_names: Sequence[str] | None = None) -> ModelLayout:
    """The layout of an (unsharded, e.g. meta) model."""
    choice = choose_blocks(model, class_names=class_names)
    in_blocks = {id(p) for b in choice.blocks for p in b.parameters()}
    root = {id(p): _shape(p) for p in model.parameters() if id(p) not in in_blocks}
    return ModelLayout(
        block_class=choice.class_name,
        block_reason=choice.describe(),
        blocks=tuple(tuple(_shape(p) for p in b.parameters()) for b in choice.blocks),
        root=tuple(root.values()),
        decoder_blocks=bool(choice.blocks)
        and all(isinstance(b, DecoderLayer) for b in choice.blocks),
    )


@functools.lru_cache(maxsize=64)
def llama_layout(shape: LlamaConfig, class_names: tuple[str, ...] = ()) -> ModelLayout:
    """The layout of the built-in Llama of ``shape`` (built on meta, cached)."""
    with torch.device("meta"):
        model = Llama(shape)
    return layout_of(model, class_names=class_names or None)


def _unit(
    name: str, shapes: Sequence[Shape], *, shard: int, blocks: tuple[int, ...], raf: bool | int,
    checkpointed: tuple[bool, ...],
) -> Unit:  # fmt: skip
    local = [-(-rows // shard) * cols for rows, cols in shapes]
    return Unit(
        name=name,
        blocks=blocks,
        numel=sum(r * c for r, c in shapes),
        sharded=sum(local),
        gathered=sum(local) * shard,
        matrix_sharded=sum(n for n, (_, cols) in zip(local, shapes) if cols > 1),
        reshard_after_forward=raf,
        checkpointed=checkpointed,
    )


def units(
    layout: ModelLayout, *, shard: int, parallel: ParallelConfig, activations: ActivationsConfig
) -> tuple[Unit, tuple[Unit, ...]]:
    """(root, block units in forward order) for a shard group of ``shard`` ranks."""
    specs = unit_specs(len(layout.blocks), parallel=parallel, activations=activations)
    out = []
    for spec in specs[:-1]:
        first, last = spec.blocks[0], spec.blocks[-1]
        label = f"layers.{first}" if first == last else f"layers.{first}-{last}"
        shapes = [s for b in spec.blocks for s in layout.blocks[b]]
        out.append(
            _unit(label, shapes, shard=shard, blocks=spec.blocks,
                  raf=spec.reshard_after_forward, checkpointed=spec.checkpointed)
        )  # fmt: skip
    root_spec = specs[-1]
    root = _unit("root", layout.root, shard=shard, blocks=(), raf=root_spec.reshard_after_forward,
                 checkpointed=())  # fmt: skip
    return root, tuple(out)
