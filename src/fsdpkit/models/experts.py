"""Which parameters of a model are routed experts, and how many of them run per token.

A mixture-of-experts layer holds E experts and routes each token to k of them. FSDP
shards, gathers, reduces and updates every expert (memory and traffic count the total
parameters), but a token is computed with the shared parameters and k / E of the
routed ones (FLOPs, MFU and step time count the active parameters). Reading one for
the other misleads both ways: a 30B-A3B model plans like 30B and computes like 3B.

Routed parameters are found by name: the path component ``experts`` holds them in
every transformers family (fused ``mlp.experts.gate_up_proj`` of shape (E, ...) since
transformers 5, per-expert ``block_sparse_moe.experts.3.w1.weight`` before), while
shared experts (``shared_expert``, ``shared_experts``) and the router (``gate``) are
named otherwise and run for every token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

EXPERT_FIELDS = (
    "num_local_experts",
    "num_experts",
    "n_routed_experts",
    "moe_num_experts",
    "n_experts",
)
"""Config fields by which transformers' mixture-of-experts families (and the built-in
MoE model's MoEConfig, the last) count their experts."""
TOP_K_FIELDS = ("num_experts_per_tok", "moe_topk", "top_k")
"""Config fields for the experts each token is routed to."""
ROUTED_COMPONENT = "experts"
"""The module path component under which transformers keeps the routed experts."""


def expert_field(config: Any) -> tuple[str, int] | None:
    """(field, count) where ``config`` describes a mixture-of-experts model, else None."""
    for field in EXPERT_FIELDS:
        count = getattr(config, field, None)
        if isinstance(count, int) and not isinstance(count, bool) and count > 0:
            return field, count
    return None


def _top_k(config: Any) -> int:
    for field in TOP_K_FIELDS:
        k = getattr(config, field, None)
        if isinstance(k, int) and not isinstance(k, bool) and k > 0:
            return k
    return 1


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts model's routing and parameter census."""

    family: str
    count: int
    """Routed experts per layer (E)."""
    top_k: int
    """Experts each token is routed to (k)."""
    total: int
    """Every parameter, tied ones once."""
    routed: int
    """Parameters inside the routed experts (all layers)."""
    layers: int
    """Layers holding routed experts."""
    implementation: str
    """transformers' experts kernel (``config._experts_implementation``), e.g. grouped_mm."""

    @property
    def active(self) -> int:
        """Parameters one token is computed with: the shared ones plus k / E of the
        routed ones."""
        return self.total - self.routed + self.routed * self.top_k // self.count

    def describe(self) -> str:
        """For the plan header and doctor: "46.70B params, 12.88B active per token
        (mixtral: 8 experts, top 2, in 32 layers)"."""
        return (
            f"{fmt_count(self.total)} params, {fmt_count(self.active)} active per token "
            f"({self.family}: {self.count} experts, top {self.top_k}, in {self.layers} layers)"
        )


def fmt_count(n: int) -> str:
    """12.88B / 3.1M, as the planner prints parameter counts."""
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"


def is_routed(name: str) -> bool:
    """True for a parameter name inside the routed experts (not shared ones)."""
    return ROUTED_COMPONENT in name.split(".")[:-1]


def experts_of(model: nn.Module) -> Experts | None:
    """The model's experts (None: a dense model, or one whose config names no expert
    count, such as a factory model without a transformers config)."""
    config = getattr(model, "config", None)
    found = expert_field(config)
    if found is None:
        return None
    total = routed = 0
    layers: set[str] = set()
    for name, p in model.named_parameters():  # tied parameters once
        total += p.numel()
        if is_routed(name):
            routed += p.numel()
            layers.add(name.split(f".{ROUTED_COMPONENT}.", 1)[0])
    if routed == 0:
        return None
    return Experts(
        family=str(getattr(config, "model_type", type(model).__name__)),
        count=found[1],
        top_k=_top_k(config),
        total=total,
        routed=routed,
        layers=len(layers),
        implementation=str(getattr(config, "_experts_implementation", None) or "eager"),
    )
