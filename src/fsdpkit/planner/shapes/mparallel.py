"""Tensor and context parallelism in the planner: what a ``parallel.tp`` x ``parallel.cp``
layout divides, what it exchanges, and which layouts are refused.

[Note: model-parallel block memory]
Per rank, with tp tensor-parallel and cp context-parallel ranks and FSDP sharding over
S = shard x cp ([Note: parallel dimensions] in fsdpkit.config.dims):

- block parameters, gradients and AdamW states: the tp-local shard of every linear
  (q/k/v and gate/up split by output rows, o and down by input columns; norms whole),
  FSDP-sharded over S: 16 bytes x block params / (tp x S). The embedding and the
  head are split by vocabulary rows over tp where the trainer splits them
  (``vocab_parallel``: plain modules, a vocabulary tp divides), so / (tp x S) too;
  the final norm is not split: / S. Unsharded (all-gathered) parameters are the
  tp-local shard: / tp.
- inside a block every head- and hidden-unit-wide tensor (q, k, v, attention output,
  the SwiGLU tensors) holds heads / tp (f / tp) over seq / cp tokens: m = b x seq / cp
  tokens at the matmuls;
- the residual stream and the norms hold n tokens: n = m / tp with sequence parallelism
  (the built-in Llama and model.hf models with Llama-named blocks), n = m without it.
  So under full checkpointing the kept block inputs are b x seq x d x e / cp (/ tp
  with sequence parallelism), and the loss head works on the m gathered tokens;
- exchange buffers (the ``exchange_buffers`` category): under sequence parallelism
  each attention / MLP input is an all-gathered (m, d) copy of the norm's output, in
  flight until the projections have read it (saved by them when the block is not
  checkpointed), and in backward the residual grad all-gathered the same way;
  under context parallelism each all-to-all's output coexists with its input for the
  exchange: q, k, v (m x (heads + 2 kv) x hd / tp), attention's output (m x heads x
  hd / tp), the same in backward (fsdpkit.planner.replay.blockmem); under ring attention
  (``parallel.cp_attention = "ring"``) the gathered k / v and the rotated k / v grads
  instead ([Note: ring attention memory] in fsdpkit.planner.replay.ringmem);
- the final norm runs on the n-token shard (SequenceParallel) and only its output is
  all-gathered for the head: the norm's saved input and normalized copy are n x d
  each, not m x d (planned on m tokens before, the analytic peak of a dp2 x tp2 / tp4
  step sat 2 x m x d x 4 x (1 - 1 / tp) over the real one, bench/plan_accuracy.py
  "MP" rows);
- RoPE under context parallelism: the model is called with each rank's global
  position ids, so cos and sin are gathered per token, b x seq / cp x hd x e each for
  the whole step (copies even in fp32, where the plain call slices views of the
  table): ``rope_bytes`` (measured: every cp row sat 0.25 MiB, exactly these two
  tensors, under the real peak without it).

Traffic per block and micro-batch, B = m x d x e bytes (ring: each rank moves
(g - 1) / g of a g-rank collective's buffer):

- tensor parallel: forward 2 all-gathers + 2 reduce-scatters of B (sequence parallel)
  or 2 all-reduces of B (2 x the bytes each): 4 x B x (tp - 1) / tp either way; the
  same in backward, and again in the recompute of a checkpointed block; plus, under
  sequence parallelism, the final hidden states gathered for the head (reduce-scattered
  back in backward) and the embedding output's grad gathered in backward: 3 x B x
  (tp - 1) / tp per micro-batch;
- context parallel: forward 4 all-to-alls (q, k, v, output) of Q + 2K + Q bytes, Q = m
  x heads x hd x e / tp, K = m x kv x hd x e / tp, each moving (cp - 1) / cp; the same
  in backward and in the recompute. Ring attention instead all-gathers the repeated k
  and v once per pass, (cp - 1) x 2Q, and a backward sends its fp32 k / v grads on at
  each of its cp steps, cp x 2Q x 4 / e (``_ring_attention``).

These exchanges sit on the critical path (a block cannot start its matmul before its
input arrives), so the recommender counts their time on top of the overlapped FSDP
traffic, over NVLink for tp (inside a node) and for cp when tp x cp fits a node.
"""

from __future__ import annotations

from dataclasses import replace

from fsdpkit.errors import ConfigError
from fsdpkit.models.experts import ROUTED_COMPONENT
from fsdpkit.models.llama import LlamaConfig
from fsdpkit.planner.errors import PlanError
from fsdpkit.planner.model.unit_layout import ModelLayout, Shape
from fsdpkit.sharding.heads import heads_cp
from fsdpkit.sharding.tensor.rules import (
    LLAMA_BLOCK,
    TensorParallelError,
    check_heads,
    vocab_refusal,
)


def _split(name: str, shape: Shape, tp: int) -> Shape:
    """The tp-local (rows, cols) of one block parameter, by the trainer's block plan
    (``LLAMA_BLOCK``, [Note: tensor-parallel plans]: the built-in Llama's module names,
    which transformers' Llama / Mistral / Qwen2 layers share). A LoRA adapter follows its
    base: lora_B of a column-parallel base splits its rows, lora_A of a row-parallel base
    its columns; the other adapter matrix, norms and biases of row-parallel linears stay
    whole."""
    module, _, leaf = name.rpartition(".")
    if ".lora_A." in name or ".lora_B." in name:
        base = name.split(".lora_", 1)[0]
        kind = LLAMA_BLOCK.get(base)
        adapter = "B" if ".lora_B." in name else "A"
        if (kind, adapter) == ("colwise", "B"):
            return -(-shape[0] // tp), shape[1]
        if (kind, adapter) == ("rowwise", "A"):
            return shape[0], -(-shape[1] // tp)
        return shape
    kind = LLAMA_BLOCK.get(module.removesuffix(".base_layer")) or _shared_expert(module)
    if kind == "colwise":
        return -(-shape[0] // tp), shape[1]
    if kind == "rowwise" and leaf == "weight":
        return shape[0], -(-shape[1] // tp)
    return shape


def _shared_expert(module: str) -> str | None:
    """A shared expert's linear inside a mixture-of-experts MLP (``mlp.shared_experts.
    gate_proj``), split as a dense MLP's ([Note: experts under tensor parallelism] in
    fsdpkit.sharding.tensor.moe); the routed experts and the router stay whole."""
    parts = module.split(".")
    if len(parts) != 3 or parts[0] != "mlp" or parts[1] == ROUTED_COMPONENT:
        return None
    return LLAMA_BLOCK.get(f"mlp.{parts[2]}")


def vocab_parallel(layout: ModelLayout, *, vocab: int, tp: int) -> bool:
    """Whether tensor parallelism splits the embedding and head by vocabulary (the
    trainer's rule, fsdpkit.sharding.tensor.rules.vocab_refusal)."""
    return tp > 1 and (
        vocab_refusal(
            plain_embedding=layout.plain_embedding,
            plain_head=layout.plain_head,
            vocab=vocab,
            embedding_rows=layout.embedding_rows,
            tp=tp,
        )
        is None
    )


def tp_layout(layout: ModelLayout, *, tp: int, vocab: int | None = None) -> ModelLayout:
    """``layout`` with every block parameter replaced by its tp-local shard; with
    ``vocab`` (``vocab_parallel``) the embedding and head rows (``vocab`` x dim, in
    the root or edge units) by theirs too. The final norm stays whole."""
    if tp == 1:
        return layout
    names = layout.block_names
    blocks = tuple(
        tuple(_split(n, s, tp) for n, s in zip(names, shapes, strict=True))
        for shapes in layout.blocks
    )

    def rows(shapes: tuple[Shape, ...]) -> tuple[Shape, ...]:
        return tuple((r // tp, c) if vocab and r == vocab and c > 1 else (r, c) for r, c in shapes)

    edges = tuple(replace(e, shapes=rows(e.shapes)) for e in layout.edges)
    return replace(layout, blocks=blocks, root=rows(layout.root), edges=edges)


def check_layout(
    model: LlamaConfig | None,
    *,
    tp: int,
    cp: int,
    attention: str = "ulysses",
) -> None:
    """Refuse a tp / cp layout the planner (and the trainer) cannot run: a PlanError of
    one paragraph naming the field. Heads divide by cp under Ulysses only (the
    trainer's ``heads_cp``). A model without a Llama shape (``model`` None: planned by
    tracing, [Note: planning any model]) is checked by the trainer's own rules instead:
    on its config (fsdpkit.sharding.tensor.rules.check_layout, called by the scenario) and
    when the trace builds it. (The world size, the node and data.seq_len are checked
    with the config: fsdpkit.config.dims.)"""
    if (tp == 1 and cp == 1) or model is None:
        return
    try:  # the trainer's own rule (fsdpkit.sharding.tensor.plans)
        check_heads(
            n_heads=model.n_heads,
            n_kv_heads=model.n_kv_heads,
            tp=tp,
            cp=heads_cp(cp=cp, attention=attention),
        )
    except (TensorParallelError, ConfigError) as exc:
        raise PlanError(str(exc)) from None


def _ring(nbytes: int, group: int) -> int:
    return nbytes * (group - 1) // group if group > 1 else 0


def exchange_traffic(
    model: LlamaConfig,
    *,
    tp: int,
    cp: int,
    sp: bool,
    tokens: int,
    e: int,
    passes: int,
    vocab: bool = False,
    ring_backwards: int | None = None,
) -> tuple[int, int, int]:
    """(tensor-parallel bytes, context-parallel bytes, collective calls) per rank for
    ``passes`` block passes (forward, backward and recompute each count one) of one
    micro-batch of ``tokens`` tokens per rank — the formulas of [Note: model-parallel
    block memory]; ``sp`` and ``vocab`` add the edges' exchanges (``_edge_traffic``).
    ``ring_backwards``: ring attention, of whose ``passes`` that many are backwards
    (``_ring_attention``)."""
    m = tokens // cp
    b = m * model.dim * e
    edge_bytes, edge_calls = _edge_traffic(b, tp=tp, sp=sp, vocab=vocab)
    tp_bytes = passes * 4 * _ring(b, tp) + edge_bytes
    q = m * model.n_heads * model.head_dim * e // tp
    k = m * model.n_kv_heads * model.head_dim * e // tp
    if ring_backwards is None:
        cp_bytes, cp_calls = passes * _ring(2 * q + 2 * k, cp), passes * 4 * (cp > 1)
    else:
        cp_bytes, cp_calls = _ring_attention(
            q, cp=cp, e=e, forwards=passes - ring_backwards, backwards=ring_backwards
        )
    return tp_bytes, cp_bytes, passes * 4 * (tp > 1) + cp_calls + edge_calls


def _ring_attention(q: int, *, cp: int, e: int, forwards: int, backwards: int) -> tuple[int, int]:
    """(bytes, calls) of ring attention over ``cp`` ranks, Q = ``q`` ([Note: ring
    attention memory] in fsdpkit.planner.replay.ringmem): every pass all-gathers the repeated
    k and v once ((cp - 1) x 2Q out of cp x 2Q); a backward also sends its fp32 k / v
    grad accumulators on, whole, at each of its cp steps (cp x 2Q x 4 / e)."""
    if cp == 1:
        return 0, 0
    gather = _ring(cp * 2 * q, cp)
    permutes = cp * 2 * q * 4 // e
    return (forwards + backwards) * gather + backwards * permutes, forwards + backwards * (1 + cp)


def _edge_traffic(b: int, *, tp: int, sp: bool, vocab: bool) -> tuple[int, int]:
    """(bytes, calls) of the embedding's and head's tp exchanges per micro-batch, B =
    ``b``: split by vocabulary, the embedding's partial sums reduce-scattered over the
    sequence (sequence parallel; its grad gathered back) or all-reduced, and the head's
    hidden-state grad all-reduced (fsdpkit.loss.chunked_ce; the per-chunk log-sum-exp
    gathers are a few bytes per token); whole under sequence parallelism, the head's
    input gathered, reduce-scattered back in backward, the embedding grad gathered."""
    if vocab:
        embedding = 2 * _ring(b, tp)  # reduce-scatter + grad gather, or all-reduce
        head = (_ring(b, tp) if sp else 0) + 2 * _ring(b, tp)  # input gather, grad ar
        return embedding + head, 4 if sp else 2
    return (3 * _ring(b, tp), 3) if sp else (0, 0)


def rope_bytes(
    *, seq_len: int, head_dim: int, tokens: int, e: int, cp: int, tables: bool = True
) -> int:
    """RoPE's cos / sin a forward holds until its backward ends ([Note: model-parallel
    block memory]): under context parallelism gathered by position id for the rank's
    ``tokens`` (micro-batch x seq / cp), copies at any dtype; otherwise views of the
    model's table, copied (seq_len rows) only by a cast to a lower compute dtype.
    Without ``tables`` (transformers' rotary embedding, [Note: transformers' Llama in
    the plan]) they are computed in every forward, seq_len rows at any dtype."""
    if cp > 1:
        return 2 * tokens * head_dim * e
    return 2 * seq_len * head_dim * e if e != 4 or not tables else 0
