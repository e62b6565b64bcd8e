"""The byte sizes one block's event model runs over and the categories its events
count in (fsdpkit.planner.replay.blockmem, fsdpkit.planner.replay.ringmem,
fsdpkit.planner.replay.headmem)."""

from __future__ import annotations

from dataclasses import dataclass

from fsdpkit.sharding.heads import kv_repeat

ACT, TEMP, GRAD, LOGITS = "activations", "temporaries", "unsharded_grads", "logits_loss"
XCHG = "exchange_buffers"
Event = tuple[str, int]


class ForWeights(int):
    """Bytes freed (negative) when a backward node that computes a weight's gradient
    has run: the gradient of its output, which that weight's gradient is made from.
    A plain int to everything but torch's zero-bubble split, whose input pass keeps
    it for the weight pass ([Note: zero-bubble backward] in fsdpkit.planner.pipeline.zerobubble)."""


@dataclass(frozen=True)
class Sizes:
    """Byte sizes of the tensors of one micro-batch through one block."""

    n: int
    """Tokens in the micro-batch (batch x seq)."""
    d: int
    f: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    e: int
    """Bytes per element of the compute dtype."""
    adapters: int = 0
    """Bytes one block's LoRA adapters save for backward beyond the base's tensors
    (``ModelLayout.adapter_width`` x tokens at the matmuls x e); 0 without LoRA."""
    frozen_linears: bool = False
    """The block's weights are all frozen and it has no adapters (``model.freeze`` of a
    block that still backpropagates): its linears save no input for a weight gradient
    (the norms' outputs and the MLP's product die with their consumers' forward)."""
    norm_grads: bool = True
    """Whether the norms' weights train; frozen (LoRA,
    fsdpkit.planner.model.finetune_layout), a norm keeps no normalized copy for a weight
    gradient."""
    inner_n: int = 0
    """Tokens per rank at the matmuls and in attention (0: ``n``). With sequence
    parallelism the residual stream and the norms hold ``n`` = inner_n / tp tokens and
    each attention / MLP input is all-gathered to ``inner_n`` ([Note: model-parallel
    block memory] in fsdpkit.planner.shapes.mparallel)."""
    tp: int = 1
    """Tensor-parallel degree (``heads``, ``kv_heads`` and ``f`` are already per rank)."""
    cp: int = 1
    """Context-parallel degree: attention exchanges heads for sequence (all-to-alls)."""
    ring: bool = False
    """Ring attention over the cp ranks (``parallel.cp_attention = "ring"``): k / v travel
    instead of heads ([Note: ring attention memory] in fsdpkit.planner.replay.ringmem)."""
    gloo: bool = False
    """CPU ranks: gloo all-gathers through a temporary of the output's size."""
    norm_casts_first: bool = False
    """RMSNorm casts its normalized input to the compute dtype before the weight
    multiplies it (transformers' ``weight * x.to(dtype)``; the built-in Llama multiplies
    in fp32): in low precision it saves that cast, not the fp32 copy nor an fp32 weight
    ([Note: transformers' Llama in the plan])."""
    gqa: bool = False
    """Attention is given k / v at their own heads (SDPA's ``enable_gqa``, transformers'
    sdpa path: [Note: transformers' Llama in the plan]): no repeated copies."""
    block_positions: bool = False
    """Ulysses attention all-gathers the whole sequence's int64 position ids in every
    block (transformers' attention, ``hf_context_parallel_attention``; the built-in
    Llama gathers them once per forward, outside the blocks)."""

    @property
    def rep(self) -> int:
        """Copies of each k / v head that attention makes and saves (1: none)."""
        return 1 if self.gqa else self.heads // self.kv_heads

    @property
    def nse(self) -> int:
        """k or v as attention saves it: repeated to every query head, or its own."""
        return self.nqe if self.rep > 1 else self.nke

    @property
    def m(self) -> int:
        """Tokens per rank at the matmuls (``inner_n``, else ``n``)."""
        return self.inner_n or self.n

    @property
    def sp(self) -> bool:
        """Sequence parallelism: the residual stream holds fewer tokens than the matmuls."""
        return self.m != self.n

    @property
    def nme(self) -> int:
        """A d-wide tensor on the matmul side (a gathered input, a partial output)."""
        return self.m * self.d * self.e

    @property
    def nh4(self) -> int:
        """Attention's fp32 log-sum-exp (one per head and token)."""
        return 4 * self.m * self.heads

    @property
    def cast(self) -> bool:
        """Whether .float() / .to(dtype) in the norms and loss make copies."""
        return self.e != 4

    @property
    def nd4(self) -> int:
        return self.n * self.d * 4

    @property
    def nde(self) -> int:
        return self.n * self.d * self.e

    @property
    def nqe(self) -> int:
        return self.m * self.heads * self.head_dim * self.e

    @property
    def nke(self) -> int:
        return self.m * self.kv_heads * self.head_dim * self.e

    @property
    def nxe(self) -> int:
        """k or v as Ulysses's all-to-all sends it: kv heads that do not divide by cp are
        repeated until they do first (fsdpkit.sharding.heads.kv_repeat). Ring
        attention sends none: ``nke``."""
        if self.cp == 1 or self.ring or self.kv_heads % self.cp == 0:
            return self.nke
        return self.nke * kv_repeat(q_heads=self.heads, kv_heads=self.kv_heads, cp=self.cp)

    @property
    def nfe(self) -> int:
        return self.m * self.f * self.e

    @property
    def nv4(self) -> int:
        return self.n * self.vocab * 4

    @property
    def nve(self) -> int:
        return self.n * self.vocab * self.e
