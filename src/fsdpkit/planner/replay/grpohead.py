"""The GRPO loss head's tensor lifetimes, as alloc/free events in the units of
[Note: block event model]: what replaces cross-entropy (fsdpkit.planner.replay.headmem's
``loss_forward`` / ``loss_backward``) in a GRPO training step.

[Note: GRPO loss head memory]
``GrpoLoss`` (fsdpkit.train.rl_step) takes the model's full logits (rows x seq x V,
compute dtype), gathers the completion positions out of them
(``completion_logits``: rows x T x V, a copy) and scores the sampled tokens with the
selective log-softmax of fsdpkit.loss.logprobs ([Note: selective log-softmax]):

- forward: ``gather`` saves its input for backward, so the full logits stay beside
  the gathered ones; per chunk of rows (``logps_chunk``) an fp32 copy when the logits
  are not fp32 or a temperature divides them, log-sum-exp's two fp32 buffers, then the
  entropy's three (log p, p, p log p); the function saves the gathered logits;
- backward: the gathered logits' gradient (``empty_like``), per chunk the fp32
  recomputation (the copy, z - lse, its exp; the exp is divided by the temperature
  into a new buffer), then the saved gathered logits die; ``gather``'s backward makes
  the full logits' gradient (zeros, scattered into) while the incoming gradient and
  the saved full logits live, and ends with the full logits' gradient alone — where
  cross-entropy's backward ends too, so the head's backward follows unchanged.

The per-token tensors ((rows, T): the log-sum-exp, log-probs, entropies, the
policy loss's ratios and masks) are a vocabulary's factor smaller and left out.
Measured (2 gloo ranks, fp32, vocab 4096, completions 1/4, 1/2 and 3/4 of the row):
the step's peak is ``max(2 full + gathered, full + 4 gathered)`` above the rest of
the step, within 0.01%.
"""

from __future__ import annotations

from fsdpkit.planner.model.grpo_terms import GrpoTerms, logps_chunk
from fsdpkit.planner.replay.blocksizes import LOGITS, TEMP, Event, Sizes


def _parts(s: Sizes, grpo: GrpoTerms, rows: int) -> tuple[int, int, int]:
    """The gathered logits (bytes), one chunk's fp32 buffer, and the chunk's copy
    (0 when the chunk is read as it is: fp32 logits, temperature 1)."""
    picked = rows * grpo.completion_len
    k4 = 4 * logps_chunk(rows=picked, vocab=s.vocab)
    copy = k4 if s.cast or grpo.temperature != 1.0 else 0
    return picked * s.vocab * s.e, k4, copy


def grpo_loss_forward(s: Sizes, grpo: GrpoTerms, *, rows: int) -> list[Event]:
    """After the head's logits (``s.nve``, live): the gathered completion logits and
    the first chunk's log-probs and entropy; ends with both logits tensors saved."""
    picked, k4, copy = _parts(s, grpo, rows)
    ev: list[Event] = [(LOGITS, picked), (TEMP, copy)]
    ev += [(TEMP, 2 * k4), (TEMP, -2 * k4), (TEMP, 3 * k4), (TEMP, -3 * k4)]
    return [*ev, (TEMP, -copy)]


def grpo_loss_backward(s: Sizes, grpo: GrpoTerms, *, rows: int) -> list[Event]:
    """From both saved logits tensors to the full logits' gradient (``s.nve``) alone."""
    picked, k4, copy = _parts(s, grpo, rows)
    scaled = k4 if grpo.temperature != 1.0 else 0
    ev: list[Event] = [(LOGITS, picked), (TEMP, copy + k4), (TEMP, k4), (TEMP, -(copy + k4))]
    ev += [(TEMP, scaled), (TEMP, -scaled), (TEMP, -k4), (LOGITS, -picked)]
    return [*ev, (LOGITS, s.nve), (LOGITS, -picked), (LOGITS, -s.nve)]


def grpo_loss_peak(s: Sizes, grpo: GrpoTerms, *, rows: int) -> int:
    """The most logits and loss bytes one micro-batch holds at once (the plan's "loss
    buffers" line): the full logits, then forward and backward above them."""
    live, peak = s.nve, s.nve
    for _, nbytes in grpo_loss_forward(s, grpo, rows=rows) + grpo_loss_backward(s, grpo, rows=rows):
        live += nbytes
        peak = max(peak, live)
    return peak
