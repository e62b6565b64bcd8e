"""Parameter shapes per FSDP unit, with FSDP2's padding, for a Llama-style model.

FSDP2 shards every parameter on dim 0 and pads dim 0 up to a multiple of the shard
group size, so a rank's shard of a (rows, cols) parameter is ceil(rows / S) * cols
elements and the all-gathered copy is ceil(rows / S) * S * cols. ``units()`` mirrors
``fsdpkit.shard``: one unit per ``blocks_per_unit`` decoder blocks, and the root unit
holding what is left (embedding, final norm, untied output head).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdpkit.models.llama import LlamaConfig


@dataclass(frozen=True)
class Unit:
    """One FSDP unit's parameters, in elements (counts are per rank where noted)."""

    name: str
    blocks: int
    """Decoder blocks in the unit (0 for the root)."""
    numel: int
    """Parameters, unpadded."""
    sharded: int
    """Elements of this rank's padded shard."""
    gathered: int
    """Elements of the padded all-gathered copy (= sharded * S)."""
    matrix_sharded: int
    """Elements of this rank's shard of the 2-D parameters (AdamW's weight-decay group,
    whose foreach step allocates one temporary of this size)."""


def block_shapes(m: LlamaConfig) -> list[tuple[int, int]]:
    """(rows, cols) of one decoder block's parameters; 1-D norms as (d, 1)."""
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    return [
        (m.dim, 1),
        (q, m.dim),
        (kv, m.dim),
        (kv, m.dim),
        (m.dim, q),
        (m.dim, 1),
        (m.ffn_dim, m.dim),
        (m.ffn_dim, m.dim),
        (m.dim, m.ffn_dim),
    ]


def root_shapes(m: LlamaConfig) -> list[tuple[int, int]]:
    """The root unit: embedding, final norm, and the output head unless tied."""
    shapes = [(m.vocab_size, m.dim), (m.dim, 1)]
    if not m.tie_embeddings:
        shapes.append((m.vocab_size, m.dim))
    return shapes


def _unit(name: str, shapes: list[tuple[int, int]], *, shard: int, blocks: int) -> Unit:
    local = [-(-rows // shard) * cols for rows, cols in shapes]
    return Unit(
        name=name,
        blocks=blocks,
        numel=sum(r * c for r, c in shapes),
        sharded=sum(local),
        gathered=sum(local) * shard,
        matrix_sharded=sum(n for n, (_, cols) in zip(local, shapes) if cols > 1),
    )


def units(m: LlamaConfig, *, shard: int, blocks_per_unit: int) -> tuple[Unit, list[Unit]]:
    """(root, block units in forward order) for a shard group of ``shard`` ranks."""
    root = _unit("root", root_shapes(m), shard=shard, blocks=0)
    out = []
    for start in range(0, m.n_layers, blocks_per_unit):
        n = min(blocks_per_unit, m.n_layers - start)
        label = f"layers.{start}" if n == 1 else f"layers.{start}-{start + n - 1}"
        out.append(_unit(label, block_shapes(m) * n, shard=shard, blocks=n))
    return root, out
