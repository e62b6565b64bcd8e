"""Built-in Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention.

Parameter names follow Hugging Face's ``LlamaForCausalLM`` exactly
(``model.layers.0.self_attn.q_proj.weight`` ...) and RoPE uses the same
"rotate half" convention, so export to HF safetensors is a rename-free copy.

Initialization is per parameter from a generator seeded by (seed, parameter name)
(see [Note: per-parameter init] in fsdpkit.init), so a model built normally and one built on the
meta device and materialized shard by shard get identical weights at any world size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from fsdpkit.models.flops import flops_per_token


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-style decoder; names match HF's LlamaConfig where they overlap."""

    vocab_size: int = 256
    """Tokens in the vocabulary (256 for the built-in byte tokenizer)."""
    dim: int = 256
    """Hidden size (HF: hidden_size)."""
    n_layers: int = 4
    """Decoder blocks (HF: num_hidden_layers)."""
    n_heads: int = 8
    """Query heads (HF: num_attention_heads)."""
    n_kv_heads: int = 4
    """Key/value heads for grouped-query attention (HF: num_key_value_heads)."""
    ffn_dim: int = 688
    """SwiGLU hidden size (HF: intermediate_size)."""
    max_seq_len: int = 256
    """Longest sequence the RoPE table covers."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = True
    """Share the token embedding with the output head."""
    init_std: float = 0.02
    """Standard deviation of the normal init of every matrix (HF: initializer_range)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be > 0, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(
                f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads})"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads "
                f"({self.n_kv_heads})"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        """Parameter count (tied head counted once)."""
        hd = self.head_dim
        attn = self.dim * self.n_heads * hd * 2 + self.dim * self.n_kv_heads * hd * 2
        mlp = 3 * self.dim * self.ffn_dim
        block = attn + mlp + 2 * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + self.n_layers * block + self.dim + head

    def matmul_params(self) -> int:
        """Parameters that multiply activations: all but an untied embedding."""
        return self.num_params() - (0 if self.tie_embeddings else self.vocab_size * self.dim)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (fsdpkit.models.flops)."""
        return flops_per_token(
            matmul_params=self.matmul_params(),
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            head_dim=self.head_dim,
            seq_len=seq_len,
        )

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _ffn(dim: int, multiplier: float = 1.3, multiple_of: int = 1024) -> int:
    hidden = int(8 * dim / 3 * multiplier)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


# Published shapes (Llama 3 / 3.1 / 3.2 model cards and HF configs).
PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(),
    "llama3-1b": LlamaConfig(
        vocab_size=128256,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=True,
    ),
    "llama3-3b": LlamaConfig(
        vocab_size=128256,
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        ffn_dim=8192,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=True,
    ),
    "llama3-8b": LlamaConfig(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=False,
    ),
    "llama3-70b": LlamaConfig(
        vocab_size=128256,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28672,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=False,
    ),
    "llama3-405b": LlamaConfig(
        vocab_size=128256,
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim=53248,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=False,
    ),
}


def preset(name: str, **overrides: object) -> LlamaConfig:
    """The named preset, with fields replaced by ``overrides``."""
    if name not in PRESETS:
        raise ValueError(f"model.preset: unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)  # type: ignore[arg-type]


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 whatever the parameter dtype."""

    def __init__(self, dim: int, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def _on_meta() -> bool:
    """Whether the model is being built under ``torch.device("meta")`` (the planner,
    ``model.meta_init``). There ``nn.Embedding``'s ``normal_`` and ``arange`` run through
    ``torch._refs``, whose first call imports ``torch._dynamo`` (~0.5 s of every
    ``fsdpkit plan``), to compute values that materialization replaces anyway
    (``param_init``, ``init_buffers``); so a meta build skips them. A CPU build computes
    and draws exactly as before."""
    return torch.get_default_device().type == "meta"


def rope_tables(*, head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (seq_len, head_dim) in HF's rotate-half layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float(), emb.sin().float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, heads, seq, head_dim) by position."""
    return (x * cos + _rotate_half(x) * sin).to(x.dtype)


def document_mask(position_ids: torch.Tensor) -> torch.Tensor | None:
    """(batch, 1, seq, seq) boolean attention mask for packed rows: causal, and a token
    sees only tokens of its own example, an example starting wherever a position is not
    its predecessor + 1 (transformers' ``find_packed_sequence_indices`` rule). None when
    no row holds more than one example (plain causal attention)."""
    start = position_ids[:, :1] - 1
    segment = (torch.diff(position_ids, prepend=start, dim=-1) != 1).cumsum(-1)
    if bool((segment[:, -1] == 0).all()):
        return None
    t = position_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    same = segment.unsqueeze(2) == segment.unsqueeze(1)
    return (same & causal).unsqueeze(1)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None
) -> torch.Tensor:
    """SDPA of q (b, h, s, d) over grouped-query k / v (b, h_kv, s, d): causal, or
    ``mask`` ((b, 1, s, s), from ``document_mask``) where given."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Attention(nn.Module):
    core: Callable[..., torch.Tensor]
    """``core(q, k, v, *, mask) -> out`` over (b, heads, s, d) after RoPE: plain
    ``causal_attention``, or context parallelism's exchange
    (fsdpkit.sharding.context.attention.apply_context_parallel replaces it). Not a module: no
    parameters, nothing in the state dict."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.core = causal_attention
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism a rank holds n_heads / tp of them
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = self.norm_heads(q, k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.core(q, k, v, mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def norm_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys (b, heads, s, d) before RoPE: unchanged in Llama; per-head
        RMSNorms in the built-in MoE model (Qwen3's, fsdpkit.models.moe)."""
        return q, k


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One pre-norm transformer block: the unit fsdpkit shards and checkpoints.
    ``attention`` / ``mlp``: the built-in MoE model's (fsdpkit.models.moe) instead of
    Llama's, under the same names."""

    def __init__(
        self, cfg: LlamaConfig, *, attention: nn.Module | None = None, mlp: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.self_attn = attention or Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = mlp or MLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    """HF's ``model.`` prefix: embeddings, blocks (``layer(cfg)`` each), final norm."""

    def __init__(self, cfg: LlamaConfig, *, layer: Callable[[LlamaConfig], nn.Module]) -> None:
        super().__init__()
        weight = torch.empty(cfg.vocab_size, cfg.dim) if _on_meta() else None  # no normal_
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim, _weight=weight)
        self.layers = nn.ModuleList(layer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)


class Llama(nn.Module):
    """Causal LM returning logits of shape (batch, seq, vocab)."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    layer_class: Callable[[LlamaConfig], nn.Module] = DecoderLayer
    """The block (the built-in MoE model's subclass gives its own)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaBody(cfg, layer=type(self).layer_class)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if _on_meta():  # values come from init_buffers() after materialization
            cos, sin = (torch.empty(cfg.max_seq_len, cfg.head_dim) for _ in range(2))
        else:
            cos, sin = rope_tables(
                head_dim=cfg.head_dim, seq_len=cfg.max_seq_len, theta=cfg.rope_theta
            )
        # Non-persistent: not in the state dict, recomputed by init_buffers() after
        # meta-device materialization (garbage otherwise).
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def get_input_embeddings(self) -> nn.Module:
        """The token embedding (Hugging Face's accessor name)."""
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        """The output head (Hugging Face's accessor name)."""
        return self.lm_head

    def forward(
        self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits of ``tokens`` (batch, seq). ``position_ids`` (batch, seq), as in Hugging
        Face models: RoPE positions, and a reset to a non-successor starts a new example
        that attends only to itself (packed SFT rows, [Note: SFT batches])."""
        t = tokens.shape[1]
        if t > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {t} exceeds model.max_seq_len {self.config.max_seq_len}"
            )
        h = self.model.embed_tokens(tokens)
        mask = None
        if position_ids is None:
            cos, sin = self.rope_cos[:t].to(h.dtype), self.rope_sin[:t].to(h.dtype)
        else:  # (batch, 1, seq, head_dim): broadcast over heads
            cos = self.rope_cos[position_ids].unsqueeze(1).to(h.dtype)
            sin = self.rope_sin[position_ids].unsqueeze(1).to(h.dtype)
            mask = document_mask(position_ids)
        for layer in self.model.layers:  # type: ignore[union-attr]
            h = layer(h, cos, sin, mask)
        return self.lm_head(self.model.norm(h))

    def init_buffers(self) -> None:
        """Recompute the RoPE tables in place (after ``to_empty``)."""
        cfg = self.config
        cos, sin = rope_tables(head_dim=cfg.head_dim, seq_len=cfg.max_seq_len, theta=cfg.rope_theta)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def param_init(self, name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
        """Full initial value of parameter ``name`` ([Note: per-parameter init], fsdpkit.init)."""
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            return torch.ones(shape)
        return torch.empty(shape).normal_(0.0, self.config.init_std, generator=generator)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (fsdpkit.models.flops)."""
        return self.config.flops_per_token(seq_len)
