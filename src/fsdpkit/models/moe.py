"""Built-in mixture-of-experts decoder for pretraining from scratch: the built-in Llama's
embedding, RoPE, attention and block code, with Qwen3's per-head q / k norms and a
top-k routed MLP (plus optional shared experts) in every block.

Module and parameter names are those of transformers' ``Qwen3MoeForCausalLM``
(``model.layers.0.mlp.gate.weight`` [E, d], ``mlp.experts.gate_up_proj`` [E, 2f, d],
``mlp.experts.down_proj`` [E, d, f], ``self_attn.q_norm.weight``), and its experts
module has transformers' interface (``forward(hidden [T, d], top_k_index [T, k],
top_k_weights [T, k])``), so one expert-parallel rule (fsdpkit.sharding.experts.parallel) and
one census (fsdpkit.models.experts: routed = under a module named ``experts``) serve
the built-in model and transformers' families alike, and an export is Qwen3-MoE's
layout. The router's load-balancing loss is transformers' (Switch Transformer eqs.
4-6) over the global batch (fsdpkit.loss.balance).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from fsdpkit.models.llama import MLP, Attention, DecoderLayer, Llama, LlamaConfig, RMSNorm

ALIGN = 8
"""Rows of a grouped GEMM operand must start on 16 bytes (8 bf16 / 4 fp32 values):
``dim`` and ``moe_ffn_dim`` are multiples of this."""


@dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    """Shape of the built-in MoE decoder; the Llama fields plus the routing ones (HF
    Qwen3MoeConfig's names in the docstrings)."""

    model_type: ClassVar[str] = "fsdpkit-moe"
    """How reports name the family (as transformers' configs do)."""

    n_experts: int = 8
    """Routed experts per block (HF: num_experts)."""
    top_k: int = 2
    """Experts each token is routed to (HF: num_experts_per_tok)."""
    moe_ffn_dim: int = 64
    """Hidden size of one routed expert's SwiGLU (HF: moe_intermediate_size)."""
    n_shared_experts: int = 0
    """Experts every token runs through besides its routed ones, as one SwiGLU of
    n_shared_experts x moe_ffn_dim hidden units (DeepSeek's shared experts); 0 = none
    (Qwen3-MoE)."""
    norm_topk_prob: bool = True
    """Renormalize the top-k routing weights to sum to 1 (HF: norm_topk_prob)."""
    router_aux_loss_coef: float = 0.001
    """Weight of the load-balancing loss (HF: router_aux_loss_coef)."""
    head_size: int = 0
    """Per-head size (HF: head_dim); 0 = dim / n_heads."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("n_experts", "top_k", "moe_ffn_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be > 0, got {getattr(self, name)}")
        if self.top_k > self.n_experts:
            raise ValueError(
                f"model.top_k ({self.top_k}) must not exceed the experts ({self.n_experts})"
            )
        for name in ("dim", "moe_ffn_dim"):
            if getattr(self, name) % ALIGN:
                raise ValueError(
                    f"model.{name} ({getattr(self, name)}) must be a multiple of {ALIGN}: the "
                    "experts run as grouped GEMMs, whose rows must start on 16 bytes"
                )

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    def _counts(self) -> tuple[int, int]:
        """(parameters of one block outside the routed experts, of its routed experts)."""
        hd, d = self.head_dim, self.dim
        attn = d * self.n_heads * hd * 2 + d * self.n_kv_heads * hd * 2 + 2 * hd
        shared = 3 * d * self.moe_ffn_dim * self.n_shared_experts
        return attn + 2 * d + d * self.n_experts + shared, self.n_experts * 3 * d * self.moe_ffn_dim

    def num_params(self) -> int:
        """Parameter count, every expert (tied head once)."""
        dense, routed = self._counts()
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + self.n_layers * (dense + routed) + self.dim + head

    def active_params(self) -> int:
        """Parameters one token is computed with: k / E of the routed experts."""
        _, routed = self._counts()
        return self.num_params() - self.n_layers * routed * (self.n_experts - self.top_k) // (
            self.n_experts
        )

    def matmul_params(self) -> int:
        """Active parameters that multiply activations: ``flops_per_token`` (the
        Llama's) counts FLOPs by active parameters (fsdpkit.models.flops)."""
        embed = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.active_params() - embed


def _qwen3(**shape: object) -> MoEConfig:
    """Qwen3-MoE's fixed choices (published config.json): RoPE theta 1e6, RMSNorm eps
    1e-6, untied head, aux loss 0.001, 151936 tokens, head_dim 128, 4 kv heads, 128
    experts, top 8, no shared experts."""
    return MoEConfig(
        vocab_size=151936, n_kv_heads=4, head_size=128, n_experts=128, top_k=8,
        max_seq_len=40960, rope_theta=1_000_000.0, norm_eps=1e-6, tie_embeddings=False,
        router_aux_loss_coef=0.001, **shape,  # type: ignore[arg-type]
    )  # fmt: skip


PRESETS: dict[str, MoEConfig] = {
    "moe-tiny": MoEConfig(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=128,
        n_experts=4,
        top_k=2,
        moe_ffn_dim=32,
        max_seq_len=256,
        router_aux_loss_coef=0.01,
    ),
    # Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B config.json (hidden_size,
    # num_hidden_layers, num_attention_heads, intermediate_size, moe_intermediate_size)
    "qwen3-30b-a3b": _qwen3(dim=2048, n_layers=48, n_heads=32, ffn_dim=6144, moe_ffn_dim=768),
    "qwen3-235b-a22b": _qwen3(dim=4096, n_layers=94, n_heads=64, ffn_dim=12288, moe_ffn_dim=1536),
}
"""The built-in MoE shapes: a tiny one for tests and two published ones for the planner."""


def preset(name: str, **overrides: object) -> MoEConfig:
    """The named MoE preset with fields replaced by ``overrides``."""
    return replace(PRESETS[name], **overrides)  # type: ignore[arg-type]


class TopKRouter(nn.Module):
    """The router (HF: Qwen3MoeTopKRouter, named ``gate``): fp32 softmax over the
    experts, the top k, renormalized when ``norm_topk_prob``; returns (logits, weights
    [T, k] in the logits' dtype, expert indices [T, k])."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.top_k, cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), index


def grouped_swiglu(
    rows: torch.Tensor, offsets: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """SwiGLU of ``rows`` sorted by expert, expert ``e`` on rows ``offsets[e-1]:offsets[e]``
    (int32 cumulative counts), as two grouped GEMMs (``torch._grouped_mm``: one kernel
    for all experts, no host sync). Rows past ``offsets[-1]`` come out zero."""
    h = torch._grouped_mm(rows, gate_up.transpose(-2, -1), offs=offsets)
    gate, up = h.chunk(2, dim=-1)
    out = torch._grouped_mm(F.silu(gate) * up, down.transpose(-2, -1), offs=offsets)
    return out


class MoEExperts(nn.Module):
    """The routed experts (named ``experts``), transformers' fused layout and
    interface. An index equal to the expert count is a dropped assignment
    (fsdpkit.sharding.experts.dispatch's capacity), computed as zero."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.num_experts = cfg.n_experts
        self.gate_up_proj = nn.Parameter(torch.empty(cfg.n_experts, 2 * cfg.moe_ffn_dim, cfg.dim))
        self.down_proj = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim, cfg.moe_ffn_dim))

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        tokens, k = top_k_index.shape
        experts = self.gate_up_proj.shape[0]  # this rank's under expert parallelism
        ids, order = torch.sort(top_k_index.reshape(-1), stable=True)
        dropped = (ids >= experts).unsqueeze(-1)  # sorted last; grouped_mm skips them
        ones = torch.ones_like(ids, dtype=torch.int32)
        counts = ones.new_zeros(experts + 1).index_add_(0, ids.clamp(max=experts), ones)
        offsets = counts[:experts].cumsum(0, dtype=torch.int32)
        rows = hidden[order // k].masked_fill(dropped, 0.0)  # zero their input gradient
        out = grouped_swiglu(rows, offsets, self.gate_up_proj, self.down_proj)
        out = out.masked_fill(dropped, 0.0) * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        unsorted = torch.empty_like(out).index_copy_(0, order, out)
        return unsorted.view(tokens, k, out.shape[-1]).sum(dim=1).to(hidden.dtype)  # 0 rows too


class SparseMoeBlock(nn.Module):
    """The block's MLP (named ``mlp``): router, routed experts, optional shared experts."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.gate = TopKRouter(cfg)
        self.experts = MoEExperts(cfg)
        self.shared_experts = (
            MLP(replace(cfg, ffn_dim=cfg.moe_ffn_dim * cfg.n_shared_experts))
            if cfg.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        _, weights, index = self.gate(flat)
        out = self.experts(flat, index, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(x.shape)


class QKNormAttention(Attention):
    """The built-in Llama's attention with Qwen3's per-head RMSNorms of q and k."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__(cfg)
        self.q_norm = RMSNorm(cfg.head_dim, eps=cfg.norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, eps=cfg.norm_eps)

    def norm_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class MoEDecoderLayer(DecoderLayer):
    """One MoE block: the built-in Llama's, with its attention and MLP replaced (the
    same module names: ``self_attn``, ``mlp``)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        assert isinstance(cfg, MoEConfig)
        super().__init__(cfg, attention=QKNormAttention(cfg), mlp=SparseMoeBlock(cfg))


class MoE(Llama):
    """Causal LM returning logits (batch, seq, vocab); the built-in Llama's forward."""

    config: MoEConfig
    layer_class = MoEDecoderLayer

    def param_init(self, name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
        """Full initial value of ``name`` ([Note: per-parameter init]): norms one,
        everything else (router and experts too) normal(0, init_std), as HF's Qwen3-MoE."""
        if name.endswith("norm.weight"):
            return torch.ones(shape)
        return super().param_init(name, shape, generator)
