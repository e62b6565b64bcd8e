"""Fine-tuning: frozen parameters, LoRA adapters (peft), adapter-only state.

Modules:
    freeze    name globs, requires_grad, trainable/total counts
    lora      peft adapters on meta, their deterministic init, the base model's view
    prepare_model the order in which a run applies them (trainer and planner)

SFT data lives in ``fsdpkit.data.sft``; adapter checkpoints and exports in
``fsdpkit.export.adapters``. See docs/finetune.md.
"""

from fsdpkit.finetune.errors import FinetuneError
from fsdpkit.finetune.freeze import ParamCounts, base_name, matches, set_trainable
from fsdpkit.finetune.lora import adapter_params, base_view, init_adapters, lora_layers
from fsdpkit.finetune.prepare_model import Finetune, prepare

__all__ = [
    "Finetune",
    "FinetuneError",
    "ParamCounts",
    "adapter_params",
    "base_name",
    "base_view",
    "init_adapters",
    "lora_layers",
    "matches",
    "prepare",
    "set_trainable",
]
