"""Tensor lifetimes of the loss head, as alloc/free events: the final norm, the head's
logits and the loss (full logits, or the chunked linear cross-entropy), their
backward, and the embedding's gradient. The events and their units are those of
[Note: block event model] in fsdpkit.planner.replay.blockmem.
"""

from __future__ import annotations

from fsdpkit.loss.chunked_ce import backward_chunks
from fsdpkit.planner.replay.blockmem import (
    ACT,
    GRAD,
    LOGITS,
    TEMP,
    Event,
    Sizes,
    norm_backward,
    norm_forward,
)
from fsdpkit.planner.replay.blocksizes import ForWeights


def head_forward(s: Sizes) -> list[Event]:
    """Final norm and the output head, with the last block's output (counted by the
    caller) live: in low precision it dies here, in fp32 the norm saves it."""
    ev = norm_forward(s, keep=True)
    ev += [(ACT, -s.nde)] if s.cast else []
    return [*ev, (LOGITS, s.nve)]


def loss_forward(s: Sizes) -> list[Event]:
    """cross_entropy(logits.float(), targets) inside a helper: the fp32 copy and
    log_softmax's output (saved) coexist with the logits; when the helper returns
    only the saved log-probabilities remain."""
    ev: list[Event] = [(LOGITS, s.nv4)] if s.cast else []
    ev += [(LOGITS, s.nv4), (TEMP, 8 * s.n)]  # log_softmax; the flattened targets
    return [*ev, (LOGITS, -(s.nv4 if s.cast else 0) - s.nve), (TEMP, -8 * s.n)]


def loss_backward(s: Sizes) -> list[Event]:
    """nll_loss's dense grad, log_softmax's grad, then the cast back to the logits'
    dtype: ends with the logits' grad (N*V*e) live."""
    ev: list[Event] = [(LOGITS, 2 * s.nv4), (LOGITS, -2 * s.nv4)]
    return ev + ([(LOGITS, s.nve), (LOGITS, -s.nv4)] if s.cast else [])


def chunked_head_forward(s: Sizes) -> list[Event]:
    """Final norm; the head computes nothing (its input is the chunked loss's)."""
    return norm_forward(s, keep=True) + ([(ACT, -s.nde)] if s.cast else [])


def chunked_loss_forward(s: Sizes, *, chunk: int) -> list[Event]:
    """[Note: chunked cross-entropy] in fsdpkit.loss.chunked_ce, forward: the
    flattened targets (a copy of the shifted ids) and the per-token log-sum-exp stay for
    backward; per chunk of c tokens the logits (c*V*e) and their fp32 copy (c*V*4, in
    which the log-sum-exp is computed in place) exist at once, then die."""
    ce, c4 = _chunk_bytes(s, chunk)
    ev: list[Event] = [(LOGITS, 12 * s.n)]
    ev += [(LOGITS, ce), (LOGITS, c4), (LOGITS, -ce)] if s.cast else [(LOGITS, c4)]
    return [*ev, (LOGITS, -c4)]


def chunked_loss_backward(
    s: Sizes, *, chunk: int, weight_grad: bool = True, norm: bool = True
) -> list[Event]:
    """Backward of the chunked loss and the head together, then the final norm: the
    hidden states' grad (N*d*e) first; per chunk the recomputed logits and their fp32
    copy (which becomes the gradient in place), then its cast to the compute dtype;
    the head's weight grad (V*d*e) is the first chunk's product, later ones add into
    it in place, so from the second chunk on it coexists with a chunk's buffers
    ([Note: chunked cross-entropy peak]). Ends as ``head_backward`` ends."""
    w = s.vocab * s.d * s.e if weight_grad else 0
    rows = backward_chunks(s.n, chunk, cast=s.cast)[:2]
    ev: list[Event] = [(TEMP, s.nde)]
    ev += _chunk_backward(s, rows[0].stop - rows[0].start, grad=[(GRAD, w)])
    if len(rows) > 1:  # the second chunk, the largest beside the weight grad
        ev += _chunk_backward(s, rows[1].stop - rows[1].start, grad=[])
    return ev + chunked_loss_saved(s) + (final_norm_backward(s) if norm else [])


def chunked_loss_saved(s: Sizes) -> list[Event]:
    """The chunked loss node's saved log-sum-exp and targets, and the head's input,
    freed after its backward."""
    return [(LOGITS, -12 * s.n), (ACT, -(s.nde if s.cast else s.nd4))]


def _chunk_backward(s: Sizes, c: int, *, grad: list[Event]) -> list[Event]:
    """One chunk's recomputed logits -> fp32 gradient -> compute dtype; ``grad``
    happens while the cast gradient is live (the first chunk's weight-grad product)."""
    ce, c4 = c * s.vocab * s.e, c * s.vocab * 4
    if not s.cast:
        return [(LOGITS, c4), *grad, (LOGITS, -c4)]
    return [(LOGITS, ce), (LOGITS, c4), (LOGITS, -ce), (LOGITS, ce), (LOGITS, -c4), *grad,
            (LOGITS, -ce)]  # fmt: skip


def _chunk_bytes(s: Sizes, chunk: int) -> tuple[int, int]:
    """Logits of one chunk in the compute dtype and in fp32."""
    c = min(chunk, s.n)
    return c * s.vocab * s.e, c * s.vocab * 4


def head_backward(s: Sizes, *, weight_grad: bool = True, norm: bool = True) -> list[Event]:
    """Output head (grad of its input, then of the weight unless it is frozen), then
    the final norm (``norm``; else the caller applies ``final_norm_backward``): ends
    with the last block output's grad (N*d*e) live, the head weight grad kept."""
    w = s.vocab * s.d * s.e if weight_grad else 0
    y = s.nde if s.cast else s.nd4
    ev: list[Event] = [(TEMP, s.nde), (GRAD, w), (LOGITS, ForWeights(-s.nve)), (ACT, -y)]
    return ev + (final_norm_backward(s) if norm else [])


def final_norm_backward(s: Sizes) -> list[Event]:
    """The final norm's backward after the head's: ends with the last block output's
    grad (N*d*e) live."""
    return [*norm_backward(s), (TEMP, s.nde)]


def embedding_backward(
    s: Sizes, *, tied: bool, workspace: int = 0, in_place: bool = False, split: int = 1
) -> list[Event]:
    """Dense embedding grad (V*d*e); a tied weight adds it to the head's grad out of
    place (autograd's AccumulateGrad sums into a new buffer when the existing grad is
    referenced elsewhere, as FSDP2's unsharded gradient is): for a moment the head's
    grad, the embedding's and their sum coexist (measured on the V2 rows of
    bench/plan_accuracy.py). ``in_place``: the head's grad is the chunked loss's own
    contiguous tensor, which autograd's input buffer adds into in place (measured: the
    sum is never a third buffer). ``split``: the vocabulary is split over this many tp
    ranks and ``s.vocab`` is this rank's rows ([Note: vocabulary-split embedding
    backward]). Frees the incoming grad of the embedding output."""
    if split > 1:
        return _split_embedding_backward(s, tied=tied, workspace=workspace, split=split)
    w = s.vocab * s.d * s.e
    ev: list[Event] = [(TEMP, workspace), (GRAD, w), (TEMP, -workspace)]
    if tied:
        ev += [(GRAD, -w)] if in_place else [(GRAD, w), (GRAD, -w), (GRAD, -w)]
    return [*ev, (TEMP, -s.nde)]


def _split_embedding_backward(s: Sizes, *, tied: bool, workspace: int, split: int) -> list[Event]:
    """[Note: vocabulary-split embedding backward]
    Split by vocabulary over tp (fsdpkit.sharding.tensor.edges), the embedding's weight
    is a Shard(0) DTensor, and DTensor has no row-sharded rule for the embedding's
    backward (``embedding_dense_backward``: replicated, column-sharded, batch-sharded
    to a partial sum, partial): with the output's grad gathered whole and the ids
    replicated it runs replicated and makes the grad of the whole vocabulary, ``split``
    x this rank's V / tp x d rows in the compute dtype; the gathered incoming grad dies
    with the op. Redistributed to the weight's Shard(0), the rank's rows are copied
    out of it (a clone, not a view). Tied, that copy is made by the out-of-place sum
    with the head's grad (both grads are DTensors): the head's grad, the whole
    vocabulary's, the copy and the sum coexist, then all but the sum die. Untied, FSDP2's
    post-backward makes the copy (``_get_grad_inner_tensor``) and drops the whole one
    (``grad = None``) before the reduce-scatter's copy-in, with nothing allocated in
    between: booked here. Measured on 4 gloo ranks (bench/plan_accuracy.py "MP T bf16
    tp2 x cp2 +AC", whose step peaks at the tied sum: tp + 3 buffers of V / tp x d
    where the plan had three): -4.4% without this, 0.0% with it and RoPE's tensors
    freed in the first block's backward (fsdpkit.planner.replay.walk); its fp32 and untied
    variants -6.4% / -1.1% before, 0.0% / -0.7% after. (The traced plan of the untied
    one reads +4.1%: torch's FSDPMemTracker keeps the last parameter's unsharded grad,
    here the whole vocabulary's, through its wrapper of FSDP2's post-backward.)"""
    w = s.vocab * s.d * s.e
    whole = split * w
    ev: list[Event] = [(TEMP, workspace), (GRAD, whole), (TEMP, -workspace), (TEMP, -s.nde)]
    ev += [(GRAD, w)]  # this rank's rows, copied out of the whole vocabulary's grad
    if tied:  # summed with the head's grad into a new buffer; the copy and the head's die
        ev += [(GRAD, w), (GRAD, -w), (GRAD, -w)]
    return [*ev, (GRAD, -whole)]


def loss_buffer_peak(s: Sizes, *, chunk: int | None) -> int:
    """The most logits and loss bytes live at once over the loss's forward and
    backward (full logits when ``chunk`` is None)."""
    if chunk is None:
        events = head_forward(s) + loss_forward(s) + loss_backward(s) + head_backward(s)
    else:
        events = chunked_loss_forward(s, chunk=chunk) + chunked_loss_backward(s, chunk=chunk)
    live = peak = 0
    for category, nbytes in events:
        if category == LOGITS:
            live += nbytes
            peak = max(peak, live)
    return peak


def hidden_gather(s: Sizes, hs: Sizes) -> list[Event]:
    """Sequence parallelism ([Note: model-parallel block memory] in
    fsdpkit.planner.shapes.mparallel): the last block's output (``s.n`` tokens) all-gathered to
    the head's ``hs.n`` tokens; the shard dies. Nothing without it."""
    return [(ACT, hs.nde), (ACT, -s.nde)] if hs.n != s.n else []


def hidden_grad_scatter(s: Sizes, hs: Sizes) -> list[Event]:
    """Its backward: the gathered hidden states' grad (live) reduce-scattered back."""
    return [(TEMP, s.nde), (TEMP, -hs.nde)] if hs.n != s.n else []


def embedding_grad_gather(s: Sizes, hs: Sizes) -> list[Event]:
    """The embedding's backward under sequence parallelism: the grad of its output
    shard (``s.n`` tokens, live) all-gathered to the whole ``hs.n`` tokens."""
    return [(TEMP, hs.nde), (TEMP, -s.nde)] if hs.n != s.n else []


def embedding_output(s: Sizes, hs: Sizes, *, kept: bool = False) -> list[Event]:
    """The embedding's output (replicated over tp), cut to the rank's sequence shard
    under sequence parallelism (a copy: the whole output dies after it, unless ``kept``:
    transformers' body holds it to the end of its forward, sizing.kept_embedding)."""
    if hs.n == s.n:
        return [(ACT, s.nde)]
    return [(ACT, hs.nde), (ACT, s.nde)] + ([] if kept else [(ACT, -hs.nde)])
