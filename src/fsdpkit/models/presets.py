"""The built-in models by preset name: the Llama shapes (fsdpkit.models.llama) and the
mixture-of-experts ones (fsdpkit.models.moe), one table for ``model.preset``."""

from __future__ import annotations

from dataclasses import replace

from fsdpkit.models import llama, moe
from fsdpkit.models.llama import Llama, LlamaConfig

PRESETS: dict[str, LlamaConfig] = {**llama.PRESETS, **moe.PRESETS}
"""Every ``model.preset`` name and its shape."""

MOE_OVERRIDES = {"experts": "n_experts", "top_k": "top_k"}
"""``model.*`` overrides of an MoE preset, and the MoEConfig field each sets."""


def preset(name: str, **overrides: object) -> LlamaConfig:
    """The named preset with fields replaced by ``overrides`` (ValueError naming the
    field for an unknown preset or an MoE field on a Llama preset)."""
    if name not in PRESETS:
        raise ValueError(f"model.preset: unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    shape = PRESETS[name]
    if not isinstance(shape, moe.MoEConfig):
        extra = [k for k in overrides if k in MOE_OVERRIDES.values()]
        if extra:
            key = next(k for k, v in MOE_OVERRIDES.items() if v == extra[0])
            raise ValueError(
                f"model.{key} sizes the experts of a mixture-of-experts preset, but "
                f"model.preset = {name!r} is a dense Llama; remove model.{key} or choose "
                f"an MoE preset ({', '.join(moe.PRESETS)})."
            )
    return replace(shape, **overrides)  # type: ignore[arg-type]


def is_moe(shape: LlamaConfig | None) -> bool:
    """Whether a built-in shape routes experts."""
    return isinstance(shape, moe.MoEConfig)


def builtin_model(shape: LlamaConfig) -> Llama:
    """The built-in model of ``shape``: MoE for an MoEConfig, else Llama."""
    return moe.MoE(shape) if isinstance(shape, moe.MoEConfig) else Llama(shape)
