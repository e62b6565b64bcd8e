"""LoRA adapters through ``peft``, built on the meta device and sharded with their blocks.

[Note: LoRA with FSDP2]
Adapters are injected with ``peft.inject_adapter_in_model`` into the model as built
(parameters on meta, ``low_cpu_mem_usage``), before ``fully_shard``: each adapter sits
inside its linear layer, so it belongs to that layer's block unit and is all-gathered
and reduce-scattered with it. peft renames a wrapped layer's weight to
``<layer>.base_layer.weight`` and adds ``<layer>.lora_A.default.weight`` (r x in) and
``<layer>.lora_B.default.weight`` (out x r); everything but the adapters is frozen.

Initialization stays deterministic and world-size independent ([Note: per-parameter
init]): the base is filled by the model's own initializer (HF weights, the model's
``_init_weights``, fsdpkit's default) through ``base_view``, which puts each base layer
back in its parent's place for the duration, so the base has exactly the names (and so
the seeds and checkpoint keys) of the model without adapters; then ``lora_A`` is drawn
from uniform(+-1/sqrt(in)) (peft's kaiming_uniform(a=sqrt(5)) distribution) with a
generator seeded by (seed, its name), and ``lora_B`` is zero, so the adapted model
starts equal to the base.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from fsdpkit.config import LoraConfig
from fsdpkit.finetune.errors import FinetuneError
from fsdpkit.finetune.freeze import select
from fsdpkit.init import copy_full_value, param_seed

ADAPTER = "default"
"""peft's adapter name (it appears in parameter names, never in exported files)."""

ALL_LINEAR = "all-linear"
"""``lora.targets`` entry for every linear layer inside the blocks."""

_LINEAR_CLASSES = ("Linear", "Conv1D")
"""Layer classes that take adapters: ``nn.Linear`` and transformers' ``Conv1D`` (GPT-2)."""


def peft_module() -> Any:
    try:
        import peft
    except ImportError:
        raise FinetuneError(
            "lora.rank > 0 needs the `peft` package, which is not installed. Run "
            "`pip install 'fsdpkit[lora]'`."
        ) from None
    return peft


def is_linear(module: nn.Module) -> bool:
    return type(module).__name__ in _LINEAR_CLASSES and hasattr(module, "weight")


def resolve_targets(model: nn.Module, patterns: list[str], *, blocks: list[nn.Module]) -> list[str]:
    """The names of the linear layers that get adapters (each pattern must select at
    least one; ``all-linear`` selects those inside ``blocks``)."""
    modules = dict(model.named_modules())
    inside = {id(m) for b in blocks for m in b.modules()}
    chosen: set[str] = set()
    globs = [p for p in patterns if p != ALL_LINEAR]
    if ALL_LINEAR in patterns:
        found = [n for n, m in modules.items() if id(m) in inside and is_linear(m)]
        if not found:
            raise FinetuneError(
                f"lora.targets: {ALL_LINEAR!r} found no Linear or Conv1D layer inside the "
                f"model's {len(blocks)} block(s). Name the layers with globs, e.g. "
                'lora.targets=["q_proj","v_proj"].'
            )
        chosen.update(found)
    for pattern, hits in select(globs, modules, key="lora.targets", what="modules").items():
        linear = [n for n in hits if is_linear(modules[n])]
        if not linear:
            kinds = sorted({type(modules[n]).__name__ for n in hits})
            raise FinetuneError(
                f"lora.targets: the pattern {pattern!r} matches {len(hits)} module(s) "
                f"({', '.join(kinds)}) but no Linear or Conv1D layer, and only those take "
                f"adapters. Name the linear layers inside, e.g. {_linear_hint(modules)}."
            )
        chosen.update(linear)
    return sorted(chosen, key=_natural)


def _linear_hint(modules: dict[str, nn.Module]) -> str:
    leaves = sorted({n.rpartition(".")[2] for n, m in modules.items() if is_linear(m)})
    return "lora.targets=[" + ",".join(f'"{leaf}"' for leaf in leaves[:4]) + "]"


def _natural(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def peft_config(cfg: LoraConfig, *, targets: list[str]) -> Any:
    """The ``peft.LoraConfig`` the adapters are injected with. Fully trained modules
    (``lora.trainable``) are not peft's ``modules_to_save`` here: that would wrap a copy
    of them (and untie a tied embedding); they simply keep ``requires_grad``, and only an
    export names them ``modules_to_save`` (fsdpkit.export.adapters)."""
    peft = peft_module()
    return peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(targets),
        bias="none",
    )


def inject(model: nn.Module, config: Any, *, seed: int) -> None:
    """Add the adapters to ``model`` in place (on meta when the model is; a model built
    on the CPU gets its adapters initialized here, from ``seed``)."""
    peft = peft_module()
    on_meta = any(p.is_meta for p in model.parameters())
    with warnings.catch_warnings():
        # peft switches fan_in_fan_out on for Conv1D layers itself, with a warning each
        warnings.filterwarnings("ignore", message=r".*fan_in_fan_out.*")
        peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER, low_cpu_mem_usage=on_meta)
    if not on_meta:
        init_adapters(model, seed=seed)


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """``{layer name: peft LoraLayer}`` of the model."""
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}  # type: ignore[misc]


def adapter_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """``{name: parameter}`` of every adapter matrix (lora_A and lora_B)."""
    out = {}
    for name, layer in lora_layers(model).items():
        for kind in ("lora_A", "lora_B"):
            out[f"{name}.{kind}.{ADAPTER}.weight"] = getattr(layer, kind)[ADAPTER].weight
    return out


def adapter_value(name: str, shape: torch.Size, *, seed: int) -> torch.Tensor:
    """Initial value of one adapter matrix ([Note: LoRA with FSDP2]): lora_A uniform
    +-1/sqrt(in) from its own generator, lora_B zeros."""
    if ".lora_B." in name:
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(param_seed(seed, name))
    bound = 1 / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=gen)


def init_adapters(model: nn.Module, *, seed: int) -> None:
    """Fill every adapter matrix (sharded or not) with its initial value."""
    with torch.no_grad():
        for name, param in adapter_params(model).items():
            copy_full_value(param, adapter_value(name, param.shape, seed=seed).to(param.dtype))


@contextmanager
def base_view(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, each LoRA layer's base layer stands in its parent's place, so
    the model has the base model's parameter names (a no-op without adapters)."""
    swapped = []
    for name, layer in lora_layers(model).items():
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, attr, layer.get_base_layer())  # type: ignore[operator]
        swapped.append((owner, attr, layer))
    try:
        yield model
    finally:
        for owner, attr, layer in swapped:
            setattr(owner, attr, layer)


def trainable_modules(model: nn.Module, patterns: list[str]) -> list[str]:
    """Module names ``lora.trainable`` selects (each pattern must match a module that
    owns parameters); their parameters are trained fully (peft's modules_to_save)."""
    owners = {n: m for n, m in model.named_modules() if any(True for _ in m.parameters(False))}
    hits = select(patterns, owners, key="lora.trainable", what="modules with parameters")
    return sorted({n for names in hits.values() for n in names}, key=_natural)
