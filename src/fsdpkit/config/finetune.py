"""The fine-tuning sections of a run's configuration: ``[lora]`` (adapters) and ``[dpo]``
(preference optimization). Data only, like the rest of ``fsdpkit.config.schema``, which
assembles them into ``RunConfig``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 0
    """LoRA rank r of every adapter; 0 = no adapters (full fine-tune, or model.freeze)."""
    alpha: float = 16.0
    """LoRA alpha: the adapter's output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input (0 = none; > 0 draws per-rank masks)."""
    targets: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module-name globs of the linear layers that get adapters ("q_proj" matches every
    *.q_proj); "all-linear" = every Linear/Conv1D inside the blocks (not the output head).
    Each pattern must match at least one linear layer."""
    trainable: list[str] = field(default_factory=list)
    """Parameter-name globs trained fully beside the adapters (peft's modules_to_save),
    e.g. ["model.embed_tokens.weight"]."""
    base_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Storage dtype of the frozen base: auto = the precision preset's compute dtype (bf16
    under precision.mode bf16 / bf16-pure: half the memory, the same numbers, since the
    base would be cast to bf16 for compute anyway), else fp32. Adapters stay fp32."""


@dataclass(frozen=True)
class DpoConfig:
    beta: float = 0.1
    """Inverse temperature of the preference loss: how far the policy may move from the
    reference per unit of log-ratio (SimPO's papers use 2-2.5 on length-averaged
    log-probs)."""
    loss: Literal["sigmoid", "ipo", "simpo"] = "sigmoid"
    """sigmoid = DPO (-log sigmoid of beta x the policy/reference log-ratio margin); ipo =
    IPO (squared distance of the length-averaged margin from 1/(2 beta)); simpo =
    reference-free SimPO (length-averaged log-probs, margin simpo_gamma; no reference
    model is built)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin (loss = -log sigmoid(beta x margin - simpo_gamma))."""
    reference: str | None = None
    """A Hugging Face model directory to use as the frozen reference; empty = the policy's
    own starting weights (model.hf / the built-in model, plus model.init_from). Not
    allowed with lora.rank > 0 (the reference is then the base with adapters off)."""
    reference_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Storage and compute dtype of the separate reference model: auto = bf16 when the
    run computes in bf16 (precision.mode bf16 / bf16-pure), else fp32."""
