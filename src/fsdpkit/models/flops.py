"""Training FLOPs per token: the one formula MFU and the planner's step-time ranking use.

The standard count (PaLM appendix B, nanoGPT): 6 FLOPs per matmul parameter per token
(forward 2, backward 4) plus 12 x layers x heads x head_dim x sequence length for the
attention scores and their weighted sum. "Matmul parameters" are every weight that
multiplies activations: the blocks, the final norm and the output head, but not an
untied embedding (a lookup, no FLOPs).
"""

from __future__ import annotations


def flops_per_token(
    *, matmul_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int
) -> float:
    """Training FLOPs per token of a decoder (see the module docstring)."""
    return 6.0 * matmul_params + 12.0 * n_layers * n_heads * head_dim * seq_len
