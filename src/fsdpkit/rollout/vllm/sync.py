"""The weight push: the policy's FSDP2 shards streamed, whole tensor by whole tensor, in
the checkpoint layout the engine's own loader reads.

[Note: pushing weights to the engine]
The engine loads weights the way vLLM loads a Hugging Face directory, so each tensor
must arrive under the name and in the layout ``save_pretrained`` would write:
``weight_stream`` yields exactly that, in model order, one conversion group at a time:

1. every parameter of the policy (tied ones once: the engine ties them itself) and
   every persistent floating-point buffer, unsharded with ``full_tensor()`` (a
   collective over the parameter's mesh: every rank iterates the stream to its end, in
   the same order);
2. under LoRA, a wrapped layer's ``base_layer.weight`` is sent as ``weight`` with its
   adapter folded in, ``W + scale * B @ A`` (transposed for a fan-in-fan-out layer:
   GPT-2's Conv1D), computed in fp32 into a new tensor: the policy itself is never
   merged, and ``lora_A`` / ``lora_B`` are not sent;
3. names and layouts as ``save_pretrained`` writes them, by transformers' own reverse
   conversion on the model's meta shadow (``to_checkpoint_layout``, [Note: one loading
   rule with transformers]): fused MoE experts go out per expert; a group of tensors
   converted together is gathered together;
4. each tensor cast to the engine's dtype (what the trainer computes with).

So at most one conversion group (one tensor, or one MoE layer's experts) is unsharded
at a time, beside the bucket it is copied into (fsdpkit.rollout.vllm.wire).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdpkit.checkpoint.hf_convert import export_groups, to_checkpoint_layout
from fsdpkit.finetune.lora import ADAPTER


@dataclass(frozen=True)
class Merge:
    """One LoRA layer's adapter, folded into its base weight when pushed."""

    a: str
    b: str
    scale: float
    transpose: bool


@dataclass(frozen=True)
class Layout:
    """Where each pushed tensor comes from."""

    sources: dict[str, str]
    """Pushed (model-layout) name -> the policy's parameter or buffer name."""
    merges: dict[str, Merge]
    """Pushed name -> its adapter, for LoRA-wrapped weights."""
    shadow: nn.Module | None
    """The transformers model on meta whose reverse conversion gives the checkpoint
    layout; None for models whose names are already it."""

    def groups(self) -> list[list[str]]:
        names = list(self.sources)
        if self.shadow is None:
            return [[n] for n in names]
        return export_groups(self.shadow, names)


def lora_merges(model: nn.Module) -> dict[str, Merge]:
    """Every peft LoRA layer of ``model``, by its base weight's name without
    ``base_layer``."""
    out = {}
    for prefix, module in model.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if not hasattr(module, "base_layer") or lora_a is None or ADAPTER not in lora_a:
            continue
        out[f"{prefix}.weight"] = Merge(
            a=f"{prefix}.lora_A.{ADAPTER}.weight",
            b=f"{prefix}.lora_B.{ADAPTER}.weight",
            scale=float(module.scaling[ADAPTER]),
            transpose=bool(getattr(module, "fan_in_fan_out", False)),
        )
    return out


def layout(model: nn.Module, *, shadow: nn.Module | None) -> Layout:
    """The push's layout of ``model`` ([Note: pushing weights to the engine])."""
    merges = lora_merges(model)
    adapters = {n for m in merges.values() for n in (m.a, m.b)}
    sources: dict[str, str] = {}
    for name, _ in model.named_parameters():
        if name not in adapters:
            sources[name.replace(".base_layer.", ".")] = name
    persistent = set(model.state_dict(keep_vars=True))
    for name, buf in model.named_buffers():
        if name in persistent and buf.is_floating_point():
            sources[name.replace(".base_layer.", ".")] = name
    return Layout(sources=sources, merges=merges, shadow=shadow)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` unsharded (collective for a DTensor)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _value(model_tensors: dict[str, torch.Tensor], name: str, plan: Layout) -> torch.Tensor:
    value = _whole(model_tensors[plan.sources[name]])
    merge = plan.merges.get(name)
    if merge is None:
        return value
    a = _whole(model_tensors[merge.a]).float()
    b = _whole(model_tensors[merge.b]).float()
    delta = merge.scale * (b @ a)
    return value.float() + (delta.t() if merge.transpose else delta)


@torch.no_grad()
def weight_stream(
    model: nn.Module, plan: Layout, *, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, whole tensor in ``dtype``), one conversion group at a time;
    collective: every rank must run it to the end."""
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    for group in plan.groups():
        values = {name: _value(tensors, name, plan) for name in group}
        if plan.shadow is not None:
            values = to_checkpoint_layout(plan.shadow, values)
        for name, value in values.items():
            yield name, value.to(dtype).contiguous()
        del values


def largest_bytes(model: nn.Module, *, dtype: torch.dtype) -> int:
    """The largest single tensor a push may send (an upper bound: a conversion only
    splits tensors)."""
    return max((p.numel() * dtype.itemsize for p in model.parameters()), default=0)
