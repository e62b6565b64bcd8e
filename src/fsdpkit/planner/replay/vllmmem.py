"""The rollout phase of a GRPO step with ``rl.engine = vllm``: one rank's memory while
the weights are pushed into its vLLM engine and the engine decodes. Pure functions over
plain numbers: the engine sizes its KV cache with ``kv_cache_bytes`` and the plan counts
that same figure.

[Note: vLLM rollout memory]
With vLLM the policy is never gathered whole on the trainer's side. A rank holds all
step what it holds without vLLM (the sharded parameters, the optimizer states, the
buffers, a reference's shards), and beside it, on the same device (CUDA: the rank's own
GPU; CPU: the same host):

- the push (fsdpkit.rollout.vllm.sync): each tensor unsharded in turn on the trainer's
  side (the largest counts) and copied into a shared-memory bucket of
  ``rl.vllm_sync_bucket_mb`` (host memory: on a CPU rank it is the rank's own, as much
  of it as a push fills, at most the whole model), while the engine holds its weights
  (the whole model in the compute dtype);
- the decode: the engine's weights and its KV cache: ``rl.vllm_kv_cache_mb``, or by
  default ``kv_cache_bytes`` for this rank's prompts x G sequences of P + C tokens in
  whole blocks of ``BLOCK`` tokens (plus one spare block each), and the logits of its
  batch (sequences x vocabulary, fp32).

What the plan does not count: vLLM's own workspace (its profiling run's activations,
CUDA graphs, the CUDA context), which vLLM sizes itself; so with vLLM the rollout phase
is a lower bound, said in the plan. With sleep mode (CUDA, ``rl.vllm_enable_sleep_mode``)
the engine frees its weights and cache while the trainer steps, so the training phase is
the one without vLLM. On CPU there is no sleep mode: the engine's weights and cache stay
through the training phase too, and the plan adds them there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BLOCK = 128
"""vLLM's KV-cache block, in tokens."""
MIB = 1 << 20


def kv_cache_bytes(
    *, layers: int, kv_heads: int, head_dim: int, itemsize: int, sequences: int, tokens: int
) -> int:
    """One rollout's KV cache: ``sequences`` of up to ``tokens`` tokens, in whole
    blocks plus one spare block each (at least 16 MiB)."""
    per_token = 2 * layers * kv_heads * head_dim * itemsize
    blocks = math.ceil(tokens / BLOCK) + 1
    return max(sequences * blocks * BLOCK * per_token, 16 * MIB)


@dataclass(frozen=True)
class VllmRollout:
    """The engine's side of one rank's rollout ([Note: vLLM rollout memory])."""

    weights: int
    """The engine's copy of the whole model, in the compute dtype."""
    kv_cache: int
    bucket: int
    """The push's device bytes beyond the engine: the largest tensor unsharded, and on
    CPU the filled part of the shared-memory bucket."""
    logits: int
    """The engine's batch logits (sequences x vocabulary, fp32)."""

    def moments(self) -> dict[str, dict[str, int]]:
        """The push and the decode, beyond what the rank holds all step."""
        return {
            "weight push into the vLLM engine": {
                "vllm_engine": self.weights,
                "collective_buffers": self.bucket,
            },
            "vLLM engine decoding": {
                "vllm_engine": self.weights + self.kv_cache,
                "rollout_logits": self.logits,
            },
        }


def vllm_rollout(
    *,
    weights: int,
    largest_tensor: int,
    bucket_mb: int,
    kv_cache_mb: int,
    sequences: int,
    tokens: int,
    vocab: int,
    layers: int,
    kv_heads: int,
    head_dim: int,
    itemsize: int,
    host: bool,
) -> VllmRollout:
    """The engine's memory for ``sequences`` completions of up to ``tokens`` tokens;
    ``host``: the rank's device is the host (CPU), which holds the push's bucket."""
    kv = kv_cache_mb * MIB or kv_cache_bytes(
        layers=layers, kv_heads=kv_heads, head_dim=head_dim, itemsize=itemsize,
        sequences=sequences, tokens=tokens,
    )  # fmt: skip
    return VllmRollout(
        weights=weights,
        kv_cache=kv,
        bucket=largest_tensor + (min(bucket_mb * MIB, weights) if host else 0),
        logits=4 * sequences * vocab,
    )
