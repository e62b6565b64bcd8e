"""The units the planner plans: those ``shard()`` builds, read off the model on meta.

``model_layout`` builds the run's model on the meta device (no memory), asks
``fsdpkit.sharding.choose_blocks`` which blocks it has (``parallel.block_classes``
included) and records every parameter's shape per block and for the root.
The untied embedding and head, which ``shard()`` gives units of their own
(``fsdpkit.sharding.edge_modules``), are recorded apart from the root.
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
from fsdpkit.loss.head import output_head
from fsdpkit.models.accessors import input_embeddings, input_vocab, is_norm, output_embeddings
from fsdpkit.models.experts import is_routed
from fsdpkit.models.llama import DecoderLayer, LlamaConfig
from fsdpkit.models.presets import builtin_model
from fsdpkit.sharding import choose_blocks, unit_specs
from fsdpkit.sharding.edges import edge_modules
from fsdpkit.sharding.tensor.rules import sequence_parallel_applies
from fsdpkit.sharding.units import block_specs

Shape = tuple[int, int]
"""(rows, cols) of a parameter as FSDP2 shards it: dim 0, and the rest flattened."""


@dataclass(frozen=True)
class EdgeLayout:
    """An untied embedding or head, a unit of its own ([Note: edge units])."""

    role: str
    """"embedding" or "head"."""
    shapes: tuple[Shape, ...]
    frozen: tuple[bool, ...] = ()
    """Per parameter: frozen (empty: everything trains)."""


@dataclass(frozen=True)
class ModelLayout:
    """Parameter shapes of a model, split as ``shard()`` splits it."""

    block_class: str | None
    block_reason: str
    blocks: tuple[tuple[Shape, ...], ...]
    """Per block in forward order, the shapes of its parameters."""
    root: tuple[Shape, ...]
    """Parameters in no block and no edge unit (a tied embedding, the final norm...)."""
    decoder_blocks: bool
    """Whether the blocks are fsdpkit's Llama decoder layers, whose activations the
    analytic model ([Note: block event model]) knows op by op."""
    frozen: tuple[tuple[bool, ...], ...] = ()
    """Per block, per parameter (as ``blocks``): frozen (no gradient, no optimizer
    state; fine-tuning runs, fsdpkit.planner.model.finetune_layout). Empty: everything trains."""
    root_frozen: tuple[bool, ...] = ()
    """The same for ``root``."""
    frozen_bytes: int = 4
    """Bytes per element of a stored frozen parameter (2 for a bf16 base: lora.base_dtype)."""
    frozen_names: tuple[str, ...] = ()
    """Root parameters that are frozen, by role: "embedding", "head" (their weight
    gradients are never computed)."""
    norms_frozen: bool = False
    """Every norm weight of the blocks is frozen (LoRA): norms save less for backward."""
    plain_head: bool = True
    """The output head is a plain ``nn.Linear`` (not LoRA-wrapped): the chunked loss
    applies (fsdpkit.loss.head)."""
    plain_embedding: bool = True
    """The input embedding is a plain ``nn.Embedding``: with ``plain_head``, what lets
    tensor parallelism split both by vocabulary (fsdpkit.sharding.tensor.rules.vocab_refusal)."""
    embedding_rows: int = 0
    """The input embedding's rows (its vocabulary)."""
    edges: tuple[EdgeLayout, ...] = ()
    """The edge units in forward order (embedding, head), where ``shard()`` makes them."""
    block_names: tuple[str, ...] = ()
    """The first block's parameter names, in the order of its shapes (tensor parallelism
    splits them by name: fsdpkit.planner.shapes.mparallel)."""
    sequence_parallel: bool = False
    """Tensor parallelism would split its norms and residual stream by sequence (the
    trainer's rule, fsdpkit.sharding.tensor.rules.sequence_parallel_applies)."""
    buffer_bytes: int = 0
    """The model's buffers, held for the whole run (the built-in Llama's RoPE tables,
    transformers' inverse frequencies)."""
    transformers_body: bool = False
    """The decoder blocks are transformers' Llama / Mistral layers run by transformers'
    body ([Note: transformers' Llama in the plan] in fsdpkit.planner.model.user_models)."""
    adapter_width: int = 0
    """Per token, what one block's LoRA adapters save for backward beyond the base's
    tensors: each adapted linear's rank-r intermediate (``lora_A``'s output, which
    ``lora_B`` saves), summed over the block's adapters (the widest block's); 0 without
    LoRA. With dropout 0 (peft's Identity) ``lora_A``'s input is the base's own."""
    routed: tuple[tuple[bool, ...], ...] = ()
    """Per block, per parameter (as ``blocks``): a routed expert's (fsdpkit.models.experts;
    expert parallelism splits these, fsdpkit.planner.experts.parallel). Empty: a dense model."""


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
    trainable_numel: int = -1
    """Trainable parameters, unpadded (-1: all of ``numel``)."""
    trainable_sharded: int = -1
    """Elements of this rank's padded shard of the trainable parameters (-1: all)."""
    trainable_matrix_sharded: int = -1
    """The same for the trainable 2-D parameters (AdamW's foreach temporary; -1: all)."""
    frozen_bytes: int = 4
    """Bytes per element of the unit's stored frozen parameters."""
    largest_sharded: int = 0
    """Elements of this rank's shard of the unit's largest trainable parameter (the
    for-loop AdamW's per-parameter temporaries)."""
    last_grad_numel: int = 0
    """Elements of the unit's last trainable parameter in FSDP2's order (the module's
    ``parameters()``), unsharded: its gradient outlives the others' into the
    reduce-scatter ([Note: the last gradient] in fsdpkit.planner.replay.gradlife)."""

    @property
    def grads_numel(self) -> int:
        """Parameters that get a gradient (fine-tuning: the trainable ones)."""
        return self.numel if self.trainable_numel < 0 else self.trainable_numel

    @property
    def grads_sharded(self) -> int:
        return self.sharded if self.trainable_sharded < 0 else self.trainable_sharded

    @property
    def grads_matrix_sharded(self) -> int:
        if self.trainable_matrix_sharded < 0:
            return self.matrix_sharded
        return self.trainable_matrix_sharded

    @property
    def sharded_param_bytes(self) -> int:
        """This rank's stored parameters: fp32 trainable (master) + frozen as stored."""
        return 4 * self.grads_sharded + self.frozen_bytes * (self.sharded - self.grads_sharded)


def _shape(p: torch.Tensor) -> Shape:
    return (p.shape[0], math.prod(p.shape[1:])) if p.dim() else (1, 1)


def layout_of(model: nn.Module, *, class_names: Sequence[str] | None = None) -> ModelLayout:
    """The layout of an (unsharded, e.g. meta) model, frozen parameters included."""
    choice = choose_blocks(model, class_names=class_names)
    edges = edge_modules(model, blocks=choice.blocks)
    elsewhere = {id(p) for m in [*choice.blocks, *edges.values()] for p in m.parameters()}
    root = {id(p): p for p in model.parameters() if id(p) not in elsewhere}
    params = list(model.parameters())
    frozen = [p for p in params if not p.requires_grad]
    tuned = bool(frozen)
    return ModelLayout(
        block_class=choice.class_name,
        block_reason=choice.describe(),
        blocks=tuple(tuple(_shape(p) for p in b.parameters()) for b in choice.blocks),
        block_names=tuple(n for n, _ in choice.blocks[0].named_parameters())
        if choice.blocks
        else (),
        sequence_parallel=sequence_parallel_applies(model, blocks=list(choice.blocks)),
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        root=tuple(_shape(p) for p in root.values()),
        decoder_blocks=bool(choice.blocks)
        and all(isinstance(b, DecoderLayer) for b in choice.blocks),
        frozen=tuple(tuple(not p.requires_grad for p in b.parameters()) for b in choice.blocks)
        if tuned
        else (),
        root_frozen=tuple(not p.requires_grad for p in root.values()) if tuned else (),
        frozen_bytes=frozen[0].element_size() if frozen else 4,
        frozen_names=_frozen_roles(model) if tuned else (),
        plain_head=output_head(model) is not None,
        plain_embedding=type(input_embeddings(model)) is nn.Embedding,
        embedding_rows=input_vocab(model, default=0),
        norms_frozen=tuned and _norms_frozen(choice.blocks),
        routed=_routed(choice.blocks),
        adapter_width=max((_adapter_width(b) for b in choice.blocks), default=0),
        edges=tuple(
            EdgeLayout(
                role=role,
                shapes=tuple(_shape(p) for p in m.parameters()),
                frozen=tuple(not p.requires_grad for p in m.parameters()) if tuned else (),
            )
            for role, m in edges.items()
        ),
    )


def _adapter_width(block: nn.Module) -> int:
    """The summed output width of a block's LoRA ``lora_A`` linears (peft keeps them
    in a ModuleDict per adapted layer)."""
    width = 0
    for module in block.modules():
        found = getattr(module, "lora_A", None)
        if isinstance(found, nn.ModuleDict):
            width += sum(getattr(a, "out_features", 0) for a in found.values())
    return width


def _routed(blocks: Sequence[nn.Module]) -> tuple[tuple[bool, ...], ...]:
    flags = tuple(tuple(is_routed(n) for n, _ in b.named_parameters()) for b in blocks)
    return flags if any(any(f) for f in flags) else ()


def _norms_frozen(blocks: Sequence[nn.Module]) -> bool:

    norms = [p for b in blocks for m in b.modules() if is_norm(m) for p in m.parameters(False)]
    return bool(norms) and not any(p.requires_grad for p in norms)


def _frozen_roles(model: nn.Module) -> tuple[str, ...]:
    """ "embedding" / "head" when that root parameter is frozen (no weight gradient)."""
    roles = []
    embed, head = input_embeddings(model), output_embeddings(model)
    for role, module in (("embedding", embed), ("head", head)):
        weight = getattr(module, "weight", None)
        if weight is not None and not weight.requires_grad:
            roles.append(role)
    return tuple(roles)


@functools.lru_cache(maxsize=64)
def llama_layout(shape: LlamaConfig, class_names: tuple[str, ...] = ()) -> ModelLayout:
    """The layout of the built-in Llama (or MoE) of ``shape`` (built on meta, cached)."""
    with torch.device("meta"):
        model = builtin_model(shape)
    return layout_of(model, class_names=class_names or None)


def make_unit(
    name: str, shapes: Sequence[Shape], *, shard: int, blocks: tuple[int, ...], raf: bool | int,
    checkpointed: tuple[bool, ...], frozen: Sequence[bool] = (), frozen_bytes: int = 4,
) -> Unit:  # fmt: skip
    local = [-(-rows // shard) * cols for rows, cols in shapes]
    train = [not f for f in frozen] if frozen else [True] * len(shapes)
    return Unit(
        name=name,
        blocks=blocks,
        numel=sum(r * c for r, c in shapes),
        sharded=sum(local),
        gathered=sum(local) * shard,
        matrix_sharded=sum(n for n, (_, cols) in zip(local, shapes) if cols > 1),
        reshard_after_forward=raf,
        checkpointed=checkpointed,
        trainable_numel=sum(r * c for (r, c), t in zip(shapes, train) if t),
        trainable_sharded=sum(n for n, t in zip(local, train) if t),
        trainable_matrix_sharded=sum(
            n for n, (_, cols), t in zip(local, shapes, train) if t and cols > 1
        ),
        frozen_bytes=frozen_bytes,
        largest_sharded=max((n for n, t in zip(local, train) if t), default=0),
        last_grad_numel=next((r * c for (r, c), t in zip(shapes[::-1], train[::-1]) if t), 0),
    )


@dataclass(frozen=True)
class Units:
    """The units of a run for a shard group, as ``shard()`` builds them."""

    root: Unit
    edges: tuple[Unit, ...]
    """The edge units in forward order, named by role ("embedding", "head")."""
    blocks: tuple[Unit, ...]
    """Block units in forward order."""


def units(
    layout: ModelLayout, *, shard: int, parallel: ParallelConfig, activations: ActivationsConfig
) -> Units:
    """The root, edge and block units for a shard group of ``shard`` ranks; without
    ``parallel.edge_units`` the edge modules' parameters stay in the root."""
    edges = {e.role: e for e in layout.edges} if parallel.edge_units else {}
    in_root = [e for e in layout.edges if e.role not in edges]
    root_shapes = [*layout.root, *(s for e in in_root for s in e.shapes)]
    root_frozen = [*layout.root_frozen, *(f for e in in_root for f in e.frozen)]
    specs = unit_specs(
        len(layout.blocks), parallel=parallel, activations=activations, edges=tuple(edges)
    )
    out = []
    for spec in block_specs(specs):
        first, last = spec.blocks[0], spec.blocks[-1]
        label = f"layers.{first}" if first == last else f"layers.{first}-{last}"
        shapes = [s for b in spec.blocks for s in layout.blocks[b]]
        frozen = [f for b in spec.blocks for f in layout.frozen[b]] if layout.frozen else []
        out.append(
            make_unit(label, shapes, shard=shard, blocks=spec.blocks,
                  raf=spec.reshard_after_forward, checkpointed=spec.checkpointed,
                  frozen=frozen, frozen_bytes=layout.frozen_bytes)
        )  # fmt: skip
    root_spec = specs[-1]
    root = make_unit("root", root_shapes, shard=shard, blocks=(),
                     raf=root_spec.reshard_after_forward, checkpointed=(), frozen=root_frozen,
                     frozen_bytes=layout.frozen_bytes)  # fmt: skip
    edge_units = tuple(
        make_unit(s.role, edges[s.role].shapes, shard=shard, blocks=(), raf=s.reshard_after_forward,
              checkpointed=(), frozen=edges[s.role].frozen, frozen_bytes=layout.frozen_bytes)
        for s in specs if s.role in edges
    )  # fmt: skip
    return Units(root=root, edges=edge_units, blocks=tuple(out))
