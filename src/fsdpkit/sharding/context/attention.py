"""Context parallelism: each sequence split across the ``cp`` mesh axis, attention by an
all-to-all head/sequence exchange (DeepSpeed-Ulysses).

[Note: Ulysses context parallelism]
A cp rank holds a contiguous slice of every sequence: seq / cp tokens, their global
position ids (so RoPE is right on every shard), and runs everything but attention on
that slice alone. Attention needs the whole sequence, so every layer exchanges:

1. q, k, v of shape (batch, heads, seq / cp, head_dim) on each rank -> one all-to-all
   each -> (batch, heads / cp, seq, head_dim): a rank now holds every token of
   ``heads / cp`` heads, the sequence in order;
2. ordinary attention (SDPA) over the full sequence: causal, or the block-diagonal
   mask of packed rows (``document_mask``) built from the *whole* sequence's
   position ids, all-gathered over cp (a rank's own slice cannot tell whether its
   first example started on the rank before);
3. one all-to-all back to (batch, heads, seq / cp, head_dim).

So heads on a rank (after tensor parallelism) must divide by cp. Grouped-query key /
value heads that do not divide by cp are repeated (by the smallest factor that makes
them divide) before the exchange. The exchange is ``all_to_all_single_autograd``
(torch.distributed._functional_collectives), which runs on gloo with autograd: its
backward is the reverse all-to-all.

Why Ulysses is the default and not ring attention (``parallel.cp_attention = "ring"``,
fsdpkit.sharding.context.ring): the attention kernel is unchanged (any mask, so packed rows
keep their document mask), and the work is balanced by heads: every rank attends over
the full sequence for heads / cp heads, so causal attention needs no load-balanced
chunk reordering. Traffic per layer: 4 all-to-alls of seq x dim / cp elements per
rank. Ring attention needs no head divisibility and holds one rank's share of the
heads' scores at a time, but only runs causal rows without a mask.

The loss side is ``context_parallel_loss`` (fsdpkit.sharding.context.batch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from fsdpkit.errors import ConfigError
from fsdpkit.models.llama import Attention, Llama, causal_attention, document_mask
from fsdpkit.pretrained import is_hf_model
from fsdpkit.sharding.context.ring import RingAttention, enable_ring
from fsdpkit.sharding.heads import check_cp_heads, kv_repeat

HF_ATTENTION = "fsdpkit_context_parallel"
"""The name fsdpkit registers with transformers' ``AttentionInterface``."""

_EXCHANGE_ATTR = "_fsdpkit_context_parallel"
"""Attribute of a transformers attention module holding its ``UlyssesAttention`` or
``RingAttention``."""


def sequence_to_heads(x: torch.Tensor, *, group: ProcessGroup, cp: int) -> torch.Tensor:
    """(b, h, s, d) on each rank, its slice of the sequence -> (b, h / cp, cp * s, d):
    the whole sequence, in rank order, of this rank's h / cp heads."""
    b, h, s, d = x.shape
    send = x.reshape(b, cp, h // cp, s, d).transpose(0, 1).contiguous()
    recv = funcol.all_to_all_single_autograd(send, None, None, group)  # dim 0: source rank
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def heads_to_sequence(x: torch.Tensor, *, group: ProcessGroup, cp: int) -> torch.Tensor:
    """The inverse of ``sequence_to_heads``: (b, h / cp, cp * s, d) -> (b, h, s, d)."""
    b, hl, t, d = x.shape
    send = x.reshape(b, hl, cp, t // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = funcol.all_to_all_single_autograd(send, None, None, group)  # dim 0: head group
    return recv.transpose(0, 1).reshape(b, cp * hl, t // cp, d)


def gather_positions(positions: torch.Tensor, *, group: ProcessGroup) -> torch.Tensor:
    """(b, s) local position ids -> (b, cp * s): the whole sequence's, in rank order."""
    gathered = funcol.all_gather_single(positions.transpose(0, 1).contiguous(), 0, group)
    return funcol.wait_tensor(gathered).transpose(0, 1)


@dataclass(frozen=True)
class UlyssesAttention:
    """The exchange of [Note: Ulysses context parallelism] over ``group``: attention of
    a rank's slice of the sequence, computed over the whole sequence."""

    group: ProcessGroup
    cp: int
    positions: _GlobalPositions | None = field(default=None, compare=False)
    """The built-in Llama's gathered position ids (set by its root pre-forward hook)."""

    def whole_mask(self, positions: torch.Tensor) -> torch.Tensor | None:
        """The whole sequence's document mask from this rank's (b, s) position ids."""
        return document_mask(gather_positions(positions, group=self.group))

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: torch.Tensor | None,
        scale: float | None = None,
        dropout: float = 0.0,
    ) -> torch.Tensor:
        """q (b, h, s, d), k / v (b, h_kv, s, d) of this rank's s tokens -> (b, h, s, d).
        ``mask``: (b, 1, cp * s, cp * s) over the whole sequence, None for causal; the
        built-in Llama's local mask is replaced by the one from its gathered positions."""
        if self.positions is not None:
            mask = self.positions.mask
        h, h_kv = q.shape[1], k.shape[1]
        if h % self.cp:
            check_cp_heads(n_heads=h, cp=self.cp)  # raises, naming parallel.cp
        if h_kv % self.cp:  # repeat grouped kv heads until they divide (say so: Note)
            f = kv_repeat(q_heads=h, kv_heads=h_kv, cp=self.cp)
            k, v = k.repeat_interleave(f, dim=1), v.repeat_interleave(f, dim=1)
        q, k, v = (sequence_to_heads(t, group=self.group, cp=self.cp) for t in (q, k, v))
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, dropout_p=dropout
        )
        return heads_to_sequence(out, group=self.group, cp=self.cp)


@dataclass(eq=False)
class _GlobalPositions:
    """The built-in Llama's whole-sequence document mask of the current forward.

    The Llama's blocks receive (x, cos, sin, mask) with ``mask`` built from the local
    positions only, so one root pre-forward hook gathers the position ids over cp (one
    small all-gather per forward, not one per layer) and keeps the whole sequence's
    mask here for every block's exchange. An activation-checkpointed block recomputes
    in the backward of the same forward, before the next forward replaces it."""

    group: ProcessGroup
    max_seq_len: int
    mask: torch.Tensor | None = None
    enabled: bool = True
    """False inside ``local_attention``."""

    def hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.enabled:
            return
        positions = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        if positions is None:
            raise ConfigError(
                "parallel.cp > 1: the model was called without position_ids, so every cp "
                "rank would place its slice of the sequence at positions 0..seq/cp-1. "
                "Call it through context_parallel_loss (fsdpkit.sharding.context.batch), "
                "which gives each rank its tokens' global positions."
            )
        full = gather_positions(positions, group=self.group)
        if full.shape[1] > self.max_seq_len:
            raise ConfigError(
                f"the whole sequence is {full.shape[1]} tokens (parallel.cp ranks x "
                f"{positions.shape[1]}), more than model.max_seq_len = {self.max_seq_len}: "
                "the RoPE table ends there. Lower data.seq_len or raise model.max_seq_len."
            )
        self.mask = document_mask(full)


def apply_context_parallel(
    model: nn.Module, *, mesh: DeviceMesh, attention: str = "ulysses"
) -> int:
    """Switch every attention layer of ``model`` to the split over ``mesh`` (the cp
    sub-mesh, fsdpkit.sharding.mesh.cp_mesh): ``attention`` "ulysses" (the exchange
    above) or "ring" (fsdpkit.sharding.context.ring, enabled for the mesh's device type), in the
    built-in Llama's ``Attention.core`` or transformers' attention implementation. Call
    after tensor parallelism and before activation checkpointing, compile and
    ``fully_shard``. Returns the number of attention layers switched; ConfigError naming
    parallel.cp for other models."""
    group, cp = mesh.get_group(), mesh.size()
    core: UlyssesAttention | RingAttention
    if attention == "ring":
        enable_ring(device_type=mesh.device_type)
        core = RingAttention(mesh)
    else:
        core = UlyssesAttention(group=group, cp=cp)
    if isinstance(model, Llama):
        if isinstance(core, UlyssesAttention):
            check_cp_heads(n_heads=model.config.n_heads, cp=cp)
            positions = _GlobalPositions(group=group, max_seq_len=model.config.max_seq_len)
            model.register_forward_pre_hook(positions.hook, with_kwargs=True)
            core = UlyssesAttention(group=group, cp=cp, positions=positions)
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        for attn in layers:
            attn.core = core
        return len(layers)
    if is_hf_model(model):
        return _apply_hf(model, core=core)
    raise ConfigError(
        f"parallel.cp > 1: fsdpkit cannot split the attention of {type(model).__name__}; "
        "context parallelism supports the built-in Llama and transformers models whose "
        "attention goes through transformers' AttentionInterface (Llama, Qwen2, "
        "Mistral, ...). Set parallel.cp = 1 for this model."
    )


@contextlib.contextmanager
def local_attention(model: nn.Module) -> Iterator[None]:
    """Inside: a model prepared by ``apply_context_parallel`` attends over the tokens
    each rank was given, with no exchange: for sampling text, where every cp rank runs
    the same whole sequence (the FSDP all-gathers still need all ranks)."""
    if is_hf_model(model):
        model.set_attn_implementation("sdpa")  # type: ignore[operator]
        try:
            yield
        finally:
            model.set_attn_implementation(HF_ATTENTION)  # type: ignore[operator]
        return
    cores = {m: m.core for m in model.modules() if isinstance(m, Attention)}
    states = {c.positions for c in cores.values() if isinstance(c, UlyssesAttention)}
    for attn in cores:
        attn.core = causal_attention
    for state in states:
        if state is not None:
            state.enabled = False
    try:
        yield
    finally:
        for attn, core in cores.items():
            attn.core = core
        for state in states:
            if state is not None:
                state.enabled = True


def _apply_hf(model: nn.Module, *, core: UlyssesAttention | RingAttention) -> int:
    from transformers import AttentionInterface

    config: Any = model.config.get_text_config()  # type: ignore[union-attr,operator]
    if isinstance(core, UlyssesAttention):
        check_cp_heads(n_heads=int(config.num_attention_heads), cp=core.cp)
    AttentionInterface.register(HF_ATTENTION, hf_context_parallel_attention)
    layers = [m for m in model.modules() if hasattr(m, "num_key_value_groups")]
    if not layers or not model._can_set_attn_implementation():  # type: ignore[operator]
        raise ConfigError(
            f"parallel.cp > 1: {type(model).__name__} does not route its attention through "
            "transformers' AttentionInterface, so fsdpkit cannot split it over the "
            "sequence. Set parallel.cp = 1 for this model."
        )
    for attn in layers:
        setattr(attn, _EXCHANGE_ATTR, core)
    model.set_attn_implementation(HF_ATTENTION)  # type: ignore[operator]
    return len(layers)


def hf_context_parallel_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (integrations/sdpa_attention.py):
    q/k/v (b, h, s, d) of this rank's tokens -> ((b, s, h, d), None). The model's own
    mask is None (transformers builds none for an implementation it has no mask
    function for); the mask comes from the whole sequence's ``position_ids`` (none under
    ring attention, which is causal over whole rows)."""
    exchange: UlyssesAttention | RingAttention | None = getattr(module, _EXCHANGE_ATTR, None)
    positions = kwargs.get("position_ids")
    unsupported = [k for k in ("sliding_window", "softcap") if kwargs.get(k) is not None]
    if not getattr(module, "is_causal", True):
        unsupported.append("bidirectional attention")
    if exchange is None or positions is None or unsupported:
        why = (
            f"{type(module).__name__} was not prepared by apply_context_parallel"
            if exchange is None
            else f"it uses {unsupported}"
            if unsupported
            else "the model was called without position_ids"
        )
        raise ConfigError(
            f"parallel.cp > 1: context-parallel attention cannot run here: {why}. "
            "Set parallel.cp = 1 for this model."
        )
    mask = exchange.whole_mask(positions.expand(query.shape[0], -1))
    out = exchange(query, key, value, mask=mask, scale=scaling, dropout=dropout)
    return out.transpose(1, 2).contiguous(), None
