"""Losses: the contract, next-token cross-entropy, SFT (answer tokens only), and the
chunked linear cross-entropy computed from the final hidden states and the head.

Modules:
    contract    ``LossFn``, ``logits_of``, ``next_token_loss`` ([Note: factory contract])
    answers     the loss of SFT micro-batches
    chunked_ce  cross-entropy of a linear head in token chunks (no full logits)
    head        ``choose_loss``: ``train.chunked_loss`` for a model, and the head hook
    grpo        the GRPO family's policy losses ([Note: GRPO loss normalization])
    advantages  group-relative advantages ([Note: group-relative advantages])
    logprobs    completion tokens' log-probs ([Note: selective log-softmax])
    router      a mixture-of-experts model's router loss ([Note: the router loss over
                the global batch]); balance: that loss from per-expert sums
    dispatch_metrics  the token dispatch's step metrics (dropped, imbalance)
"""

from fsdpkit.loss.contract import LossFn, ModelOutputError, logits_of, next_token_loss

__all__ = ["LossFn", "ModelOutputError", "logits_of", "next_token_loss"]
