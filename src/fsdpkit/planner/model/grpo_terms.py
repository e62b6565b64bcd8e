"""What ``train.objective = grpo`` changes in a plan: the two phases of its step.

[Note: the GRPO step in the plan]
A GRPO step ([Note: the GRPO step] in fsdpkit.train.rl_step) has two phases whose peaks
a plan compares; the plan's peak is the larger, and it names the phase:

- the rollout: the embedded engine gathers the whole policy once and decodes this
  rank's prompts, one decode batch of ``rl.num_generations`` rows per prompt, each
  prompt after the other ([Note: rollout memory] in fsdpkit.planner.replay.rolloutmem);
- the training: first the trainer's no-grad recompute of the sampled tokens'
  log-probs (and, with ``rl.beta > 0``, the reference's: a sharded frozen copy, or the
  adapters off under LoRA, the rule of [Note: reference in the plan]) over every
  micro-batch, then ``rl.num_iterations`` ordinary steps over micro-batches of
  ``train.micro_batch_size`` completions, each row its prompt and completion: planned
  as the language-model step at ``rl.max_prompt_length + rl.max_completion_length``
  tokens with the GRPO loss head instead of cross-entropy (``grpo_loss_forward`` in
  fsdpkit.planner.replay.headmem). Every micro-batch of the rank stays alive through
  the step (``batch_bytes``).

The plan takes the longest rows the config allows: every prompt ``max_prompt_length``
tokens, every completion running to ``max_completion_length`` (a run whose completions
stop early holds less). The GRPO loss always takes full logits: ``train.chunked_loss``
does not apply to it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdpkit.config import RunConfig
from fsdpkit.config.batch_split import BatchSplit
from fsdpkit.loss.logprobs import CHUNK_ELEMENTS

TRACED_GRPO = (
    "GRPO traced: the training phase is the language-model step (cross-entropy head) at "
    "GRPO's rows; its own loss head and the no-grad recomputes are in the analytic plan"
)
DRAW_BYTES = 32
"""Bytes per (row, vocabulary) element of one token draw (fsdpkit.rollout.sampling.draw),
beside the fp32 scaled logits: the fp64 uniforms, the Gumbel noise, the fp64 copy of
the logits and their sum are alive at once (4 x 8)."""
FILTER_BYTES = 4
"""Top-k / top-p's masked copy of the scaled logits (fp32), alive through the draw;
the filter's own sort and sums (at most 28 bytes per element, then freed) stay below
the draw's. Measured: 40 bytes per element with top-k and top-p, 36 without."""


@dataclass(frozen=True)
class GrpoTerms:
    """The numbers of a GRPO step a plan reads (from ``[rl]`` and the batch split)."""

    rows: int
    """Rows of one decode batch: one prompt's ``rl.num_generations`` completions."""
    prompt_len: int
    """``rl.max_prompt_length``: the longest prompt a step keeps."""
    completion_len: int
    """``rl.max_completion_length``."""
    decode_batches: int
    """Prompts per rank per step, decoded one after the other."""
    micro_batches: int
    """Micro-batches of completions per rank per step (all alive through the step)."""
    temperature: float
    top_k: int
    top_p: float
    ref_logps: bool
    """``rl.beta > 0``: the reference's log-probs are computed and kept."""
    engine: str = "embedded"
    """``rl.engine``: with vllm the rollout is the engine's ([Note: vLLM rollout
    memory] in fsdpkit.planner.replay.vllmmem)."""
    vllm_bucket_mb: int = 256
    vllm_kv_cache_mb: int = 0
    vllm_sleeps: bool = True
    """``rl.vllm_enable_sleep_mode`` (CUDA only: the engine frees its memory while the
    trainer steps)."""

    @property
    def seq_len(self) -> int:
        """A training row's tokens: prompt + completion."""
        return self.prompt_len + self.completion_len

    @property
    def draw_bytes(self) -> int:
        """Bytes per (row, vocabulary) element while a token is drawn: the fp32 scaled
        logits and the draw's buffers (``DRAW_BYTES``), and top-k / top-p's kept copy."""
        return 4 + DRAW_BYTES + (FILTER_BYTES if self.top_k or self.top_p < 1 else 0)

    def batch_bytes(self, micro_batch: int, *, copied: bool) -> int:
        """One rank's rollout micro-batches (fsdpkit.rollout.completion_rows), alive
        through the training phase: int64 inputs (rows x seq), positions and ids
        (rows x T), fp32 sampled / mask / engine log-probs, built in numpy and moved to
        the device (``copied``: on CPU ranks they stay numpy's memory, outside torch's
        allocator), and torch's own: the recomputed log-probs (and the reference's),
        the fp32 advantages. Measured on CPU: the plan was over by exactly numpy's."""
        t = self.completion_len
        numpy = 8 * self.seq_len + t * (8 + 8 + 3 * 4) if copied else 0
        per_row = numpy + 4 * t * (1 + self.ref_logps) + 4
        return self.micro_batches * micro_batch * per_row


def grpo_terms(cfg: RunConfig, *, split: BatchSplit, dp: int) -> GrpoTerms | None:
    """The terms of ``cfg`` under ``train.objective = grpo`` (None otherwise)."""
    if cfg.train.objective != "grpo":
        return None
    rl = cfg.rl
    return GrpoTerms(
        rows=rl.num_generations,
        prompt_len=rl.max_prompt_length,
        completion_len=rl.max_completion_length,
        decode_batches=max(1, split.global_batch // (rl.num_generations * dp)),
        micro_batches=split.grad_accum,
        temperature=rl.temperature,
        top_k=rl.top_k,
        top_p=rl.top_p,
        ref_logps=rl.beta > 0,
        engine=rl.engine,
        vllm_bucket_mb=rl.vllm_sync_bucket_mb,
        vllm_kv_cache_mb=rl.vllm_kv_cache_mb,
        vllm_sleeps=rl.vllm_enable_sleep_mode,
    )


def logps_chunk(*, rows: int, vocab: int) -> int:
    """Logit values in one chunk of fsdpkit.loss.logprobs' selective log-softmax over
    ``rows`` token rows ([Note: selective log-softmax]): ``CHUNK_ELEMENTS // vocab`` rows
    at most."""
    return min(rows, max(1, CHUNK_ELEMENTS // vocab)) * vocab


def no_grad_logits(terms: GrpoTerms, *, rows: int, vocab: int, e: int) -> int:
    """The most logits bytes a no-grad forward of a GRPO micro-batch of ``rows``
    completions holds (the trainer's recompute and the reference's; compute dtype
    ``e`` bytes): the full logits (rows x seq x V) and their gathered completion
    positions (rows x T x V, fsdpkit.rollout.completion_rows.completion_logits) at
    once; then the gathered ones with one chunk's fp32 copy (in low precision, or
    divided by the temperature) and log-sum-exp's two fp32 buffers."""
    full = rows * terms.seq_len * vocab * e
    picked = rows * terms.completion_len * vocab * e
    k4 = 4 * logps_chunk(rows=rows * terms.completion_len, vocab=vocab)
    copy = k4 if e != 4 or terms.temperature != 1.0 else 0
    return max(full + picked, picked + copy + 2 * k4)
