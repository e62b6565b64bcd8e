"""``prepare``: turn a built model into the fine-tuning run's model, before sharding.

Order: LoRA adapters (``[lora]``, [Note: LoRA with FSDP2]) -> fully trainable modules
(``lora.trainable``) -> ``model.freeze`` -> the frozen base's storage dtype
(``lora.base_dtype``) -> the initializer that fills base and adapters after sharding.
The trainer and the planner both call it, so a plan sees the units, the trainable
parameters and the dtypes the run will have.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from fsdpkit.config import RunConfig
from fsdpkit.finetune import lora as adapters
from fsdpkit.finetune.errors import FinetuneError
from fsdpkit.finetune.freeze import ParamCounts, set_trainable
from fsdpkit.init import Initializer, default_init
from fsdpkit.loss.router import router_spec
from fsdpkit.models.accessors import is_norm
from fsdpkit.precision import Precision
from fsdpkit.sharding.blocks import choose_blocks


@dataclass(frozen=True)
class Finetune:
    """What ``prepare`` did to the model (for logs, checkpoints and exports)."""

    counts: ParamCounts
    """Trainable and total parameters (tied counted once)."""
    targets: list[str] = field(default_factory=list)
    """Linear layers that got LoRA adapters (base model names)."""
    trainable_modules: list[str] = field(default_factory=list)
    """Modules trained fully beside the adapters (``lora.trainable``)."""
    base_dtype: torch.dtype | None = None
    """Storage dtype of the frozen parameters when it differs from the model's."""
    init: Initializer | None = None
    """The initializer ``shard`` runs (base through ``base_view``, then adapters)."""
    peft_config: object = None
    """The ``peft.LoraConfig`` (None without LoRA)."""
    moe_note: str | None = None
    """Under LoRA, what of a mixture-of-experts model is and is not adapted."""
    conv1d: list[str] = field(default_factory=list)
    """The targets that are transformers ``Conv1D`` layers (stored transposed), read off
    the whole model before sharding (a pipeline rank's view holds only its stages)."""

    @property
    def active(self) -> bool:
        """Whether anything is frozen (else the run is a plain full training run)."""
        return self.counts.trainable < self.counts.total

    def record(self) -> dict[str, object] | None:
        """What checkpoints record for exports (fsdpkit.export.adapters): the LoRA
        layers (and which are transformers Conv1D, stored transposed), the fully trained
        modules; None without LoRA."""
        if not self.targets:
            return None
        return {
            "lora_targets": list(self.targets),
            "conv1d": list(self.conv1d),
            "modules_to_save": list(self.trainable_modules),
        }

    def describe(self) -> str:
        parts = []
        if self.targets:
            leaves = sorted({t.rpartition(".")[2] for t in self.targets})
            parts.append(f"LoRA on {len(self.targets)} layers ({', '.join(leaves)})")
        parts.append(self.counts.describe())
        if self.base_dtype is not None:
            parts.append(f"frozen base stored in {str(self.base_dtype).removeprefix('torch.')}")
        if self.moe_note:
            parts.append(self.moe_note)
        return "; ".join(parts)


def base_dtype(cfg: RunConfig, precision: Precision) -> torch.dtype | None:
    """``lora.base_dtype`` resolved for this precision preset (None: keep fp32)."""
    wanted = cfg.lora.base_dtype
    if not cfg.lora.rank or wanted == "fp32":
        return None
    if precision.param_dtype == torch.bfloat16:
        return torch.bfloat16
    if wanted == "bf16":
        raise FinetuneError(
            f"lora.base_dtype = 'bf16' needs bf16 compute, but precision.mode = "
            f"{cfg.precision.mode!r} resolves to {precision.name} on this device, so the bf16 "
            "base would meet fp32 activations. Set precision.mode = bf16, or "
            "lora.base_dtype = auto."
        )
    return None


def cast_frozen(model: nn.Module, dtype: torch.dtype, *, keep_norms: bool) -> None:
    """Store every frozen floating-point parameter in ``dtype`` (ties kept: a shared
    parameter is replaced once, everywhere). With ``keep_norms`` (precision.norms_fp32)
    norm layers keep their fp32 weights."""

    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if keep_norms and is_norm(module):
            continue
        for key, p in module._parameters.items():
            if p is None or p.requires_grad or not p.is_floating_point() or p.dtype == dtype:
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
            module._parameters[key] = done[id(p)]


def _with_adapters(base: Initializer | None, *, seed: int) -> Initializer:
    """Fill the base under its own names, then the adapters ([Note: LoRA with FSDP2])."""

    def init(model: nn.Module) -> None:
        with adapters.base_view(model):
            if base is None:
                default_init(model, seed=seed)
            else:
                base(model)
        adapters.init_adapters(model, seed=seed)

    return init


def prepare(
    model: nn.Module, cfg: RunConfig, *, precision: Precision, init: Initializer | None
) -> Finetune:
    """Apply ``[lora]`` and ``model.freeze`` to ``model`` in place (before sharding);
    ``init`` is the model's own initializer (None: fsdpkit's default)."""
    targets: list[str] = []
    modules: list[str] = []
    conv1d: list[str] = []
    config = None
    if cfg.lora.rank:
        blocks = list(choose_blocks(model, class_names=cfg.parallel.block_classes or None).blocks)
        targets = adapters.resolve_targets(model, cfg.lora.targets, blocks=blocks)
        modules = (
            adapters.trainable_modules(model, cfg.lora.trainable) if cfg.lora.trainable else []
        )
        _no_overlap(targets, modules)
        config = adapters.peft_config(cfg.lora, targets=targets)
        conv1d = [t for t in targets if type(model.get_submodule(t)).__name__ == "Conv1D"]
        adapters.inject(model, config, seed=cfg.train.seed)
        for name in modules:
            model.get_submodule(name).requires_grad_(True)
        init = _with_adapters(init, seed=cfg.train.seed)
    if cfg.model.freeze:
        set_trainable(model, cfg.model.freeze, key="model.freeze", value=False)
    dtype = base_dtype(cfg, precision)
    if dtype is not None:
        cast_frozen(model, dtype, keep_norms=cfg.precision.norms_fp32)
    counts = ParamCounts.of(model)
    if counts.trainable == 0:
        raise FinetuneError(
            f"model.freeze = {cfg.model.freeze} freezes every parameter of the model, so "
            "there is nothing to train. Freeze fewer parameters, or add LoRA adapters "
            "(lora.rank)."
        )
    return Finetune(
        counts=counts,
        targets=targets,
        trainable_modules=modules,
        base_dtype=dtype,
        init=init,
        peft_config=config,
        moe_note=_moe_note(model) if cfg.lora.rank else None,
        conv1d=conv1d,
    )


def _moe_note(model: nn.Module) -> str | None:
    """[Note: LoRA on mixture-of-experts models]
    peft's adapters wrap linear layers. transformers 5 keeps a family's routed experts
    as fused 3-D parameters (``experts.gate_up_proj``: experts x 2 ffn x dim) and its
    router as a bare weight, so "all-linear" adapts attention (and a shared expert's
    linears where the family has one) and leaves routers and routed experts frozen.
    The run says so in its first lines; ``lora.trainable`` trains them fully."""
    spec = router_spec(model)
    if spec is None:
        return None
    routers = sum(isinstance(m, spec.recorder) for m in model.modules())
    fused = [n for n, p in model.named_parameters() if p.dim() == 3]
    return (
        f"mixture of experts: the {routers} router(s) ({spec.recorder.__name__}) and the "
        f"{len(fused)} fused expert weight(s) (e.g. {fused[0] if fused else '-'}) are not "
        "linear layers, so they get no adapters and stay frozen (lora.trainable trains "
        "them fully)"
    )


def _no_overlap(targets: list[str], modules: list[str]) -> None:
    both = sorted(set(targets) & set(modules))
    if both:
        raise FinetuneError(
            f"{both[0]!r} is both a LoRA target (lora.targets) and fully trainable "
            "(lora.trainable); a layer is either adapted or trained in full. Remove it from "
            "one of the two."
        )
