"""One rank's byte sizes of a block's tensors and of the loss head's, for a scenario
(the ``Sizes`` the event model of fsdpkit.planner.replay.blockmem and headmem runs over)."""

from __future__ import annotations

from dataclasses import replace

from fsdpkit.planner.experts.parallel import hidden_size
from fsdpkit.planner.replay.blockmem import Sizes
from fsdpkit.planner.shapes.mparallel import rope_bytes
from fsdpkit.planner.shapes.scenario import Scenario


def sizes(sc: Scenario) -> Sizes:
    """One rank's share of a block's tensors ([Note: model-parallel block memory] in
    fsdpkit.planner.shapes.mparallel): heads and hidden units / tp, tokens / cp, and the
    residual stream's tokens / tp too under sequence parallelism."""
    m = sc.model
    assert m is not None, "require_decoder_blocks first"
    inner = sc.tokens // sc.dims.cp
    return Sizes(
        n=inner // sc.dims.tp if sc.sequence_parallel else inner,
        d=m.dim,
        f=-(-m.ffn_dim // sc.dims.tp),
        heads=m.n_heads // sc.dims.tp,
        kv_heads=m.n_kv_heads // sc.dims.tp,
        head_dim=m.head_dim,
        vocab=m.vocab_size,
        e=sc.param_bytes,
        norm_grads=not sc.layout.norms_frozen,
        adapters=sc.layout.adapter_width * inner * sc.param_bytes,
        inner_n=inner,
        tp=sc.dims.tp,
        cp=sc.dims.cp,
        ring=sc.cp_attention == "ring",
        gloo=sc.device.kind != "gpu",
        norm_casts_first=sc.layout.transformers_body,
        gqa=sdpa_gqa(sc),
        block_positions=sc.layout.transformers_body,
    )


def hidden_bytes(sc: Scenario) -> int:
    """One micro-batch's hidden state on a rank (``sizes(sc).nde``: tokens / cp, / tp
    under sequence parallelism), also for a model the analytic planner has no shape of
    (its width from the layout's embedding)."""
    if sc.model is not None:
        return sizes(sc).nde
    tokens = sc.tokens // sc.dims.cp // (sc.dims.tp if sc.sequence_parallel else 1)
    return tokens * hidden_size(sc.layout) * sc.param_bytes


def sdpa_gqa(sc: Scenario) -> bool:
    """Whether attention gets k / v unrepeated: transformers' sdpa path passes
    ``enable_gqa`` when it has no mask and heads of at most 256 (``use_gqa_in_sdpa``);
    under cp fsdpkit's exchanges repeat them as the built-in Llama does ([Note:
    transformers' Llama in the plan] in fsdpkit.planner.model.user_models)."""
    m = sc.model
    assert m is not None
    return sc.layout.transformers_body and sc.dims.cp == 1 and m.head_dim <= 256


def head_sizes(sc: Scenario) -> Sizes:
    """The head and loss on the rank's seq / cp tokens (gathered over tp under sequence
    parallelism). Split by vocabulary over tp (``sc.vocab_parallel``), the chunked
    loss's buffers and the head and embedding weight grads hold vocab / tp rows; with
    full logits the vocabulary is planned whole (the logits are gathered whole: the
    weight grads, tp times smaller there, are over-counted). The final norm runs before
    the gather, on ``sizes(sc)``'s shard (fsdpkit.planner.replay.walk)."""
    s = sizes(sc)
    vocab = s.vocab // sc.dims.tp if sc.vocab_parallel and sc.loss_chunk is not None else s.vocab
    return replace(s, n=s.m, inner_n=0, tp=1, cp=1, ring=False, vocab=vocab)


def rope_held(sc: Scenario) -> int:
    """RoPE's cos / sin, from the embedding's forward to the backward of the first
    block that trains (the last to read them; traced: freed before the embedding's)."""
    s = sizes(sc)
    tables = not sc.layout.transformers_body
    return rope_bytes(
        seq_len=sc.seq_len, head_dim=s.head_dim, tokens=s.m, e=s.e, cp=sc.dims.cp, tables=tables
    )


def kept_embedding(sc: Scenario) -> int:
    """Under sequence parallelism transformers' body keeps the whole embedding output
    (``inputs_embeds``) until its forward returns, after the final norm; the first
    block's input is the shard cut from it ([Note: transformers' Llama in the plan] in
    fsdpkit.planner.model.user_models). 0 when nothing is kept."""
    s, hs = sizes(sc), head_sizes(sc)
    return hs.nde if sc.layout.transformers_body and hs.n != s.n else 0
