"""Incremental decoding with a KV cache: prefill a batch of prompts once, then one
token per row per forward, for the built-in models and transformers causal LMs.

[Note: decoding with a KV cache]
Every row of a decode batch has the same prompt (the G completions of one prompt) or
at least the same prompt length, so rows need no padding and no attention mask: the
prompt is one causal prefill, then each forward feeds one new token per row at the
same position. The model is called through its FSDP root like a training forward (its
hooks gather what is sharded: fsdpkit.rollout.embedded decides how much stays
gathered).

- Built-in Llama / MoE: every ``Attention.core`` (the SDPA after RoPE, [Note:
  tensor-parallel plans] replace it the same way under cp) is swapped for a
  ``CachedCore`` that appends this forward's keys and values to its cache and attends
  over all of them: causal for the prefill, plain for a one-token step (it sees every
  earlier position). RoPE positions come from ``position_ids``.
- transformers: the model's own ``DynamicCache`` through ``past_key_values`` and
  ``use_cache=True`` (positions follow the cache's length).

Either way the logits of a step equal those of a full forward over the same prefix to
float noise ([Note: the log-prob gap] measures exactly that, every step).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from fsdpkit.errors import UserError
from fsdpkit.loss.contract import logits_of
from fsdpkit.models.llama import Attention
from fsdpkit.pretrained import is_hf_model


class Decoder(Protocol):
    """One decode batch's state: ``prefill`` once, then ``step`` per new token."""

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits (rows, vocab) after the prompts ``ids`` (rows, prompt_len)."""
        ...

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (rows, vocab) after appending ``tokens`` (rows,)."""
        ...


class CachedCore:
    """An ``Attention.core`` that keeps the keys and values it has seen ([Note:
    decoding with a KV cache])."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None
    ) -> torch.Tensor:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        keys, values = self.k, self.v
        rep = q.shape[1] // keys.shape[1]
        if rep > 1:
            keys = keys.repeat_interleave(rep, dim=1)
            values = values.repeat_interleave(rep, dim=1)
        causal = q.shape[2] == keys.shape[2]  # the prefill; a later token sees every key
        return F.scaled_dot_product_attention(q, keys, values, is_causal=causal)


class BuiltinDecoder:
    """The built-in models' decoder: cores swapped for ``CachedCore`` while it lives
    (``cached_cores``)."""

    def __init__(self, model: nn.Module, cores: list[CachedCore]) -> None:
        self.model, self.cores, self.length = model, cores, 0

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        logits = logits_of(self.model(ids, position_ids=positions), tokens=ids)
        return logits[:, -1]

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        self.length = ids.shape[1]
        return self._forward(ids, None)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens.unsqueeze(1)
        positions = torch.full_like(ids, self.length)
        self.length += 1
        return self._forward(ids, positions)


class HFDecoder:
    """A transformers causal LM's decoder over its own ``DynamicCache``, passed as
    ``cache`` (transformers >= 5.2x) or ``past_key_values`` (earlier; deprecated since),
    whichever the model's forward names."""

    def __init__(self, model: nn.Module) -> None:
        from transformers import DynamicCache

        self.model = model
        self.cache: Any = DynamicCache()
        params = inspect.signature(type(model).forward).parameters
        self.key = "cache" if "cache" in params else "past_key_values"

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids, use_cache=True, **{self.key: self.cache})
        self.cache = getattr(out, self.key, None) or self.cache
        return logits_of(out, tokens=ids)[:, -1]

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        return self._forward(ids)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._forward(tokens.unsqueeze(1))


@contextmanager
def cached_cores(model: nn.Module) -> Iterator[list[CachedCore]]:
    """Within, every built-in ``Attention`` computes through a fresh ``CachedCore``;
    the cores it had before are put back on exit."""
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    before = [a.core for a in attentions]
    cores = [CachedCore() for _ in attentions]
    for attention, core in zip(attentions, cores):
        attention.core = core
    try:
        yield cores
    finally:
        for attention, old in zip(attentions, before):
            attention.core = old


def decoder_factory(model: nn.Module) -> Callable[[], Any]:
    """A context-manager factory giving a fresh ``Decoder`` per decode batch, for the
    model's kind ([Note: decoding with a KV cache]); a clear error for a model whose
    cache fsdpkit cannot drive (a ``model.factory`` module that is neither)."""
    if any(isinstance(m, Attention) for m in model.modules()):

        @contextmanager
        def builtin() -> Iterator[Decoder]:
            with cached_cores(model) as cores:
                yield BuiltinDecoder(model, cores)

        return builtin
    if is_hf_model(model):

        @contextmanager
        def hf() -> Iterator[Decoder]:
            yield HFDecoder(model)

        return hf
    raise RolloutModelError(
        f"train.objective = 'grpo' samples rollouts with a KV cache, which fsdpkit drives "
        f"for its built-in models and transformers causal LMs; this model "
        f"({type(model).__name__}, from model.factory) is neither. Train it with a "
        "built-in preset or a model.hf directory, or use another objective."
    )


class RolloutModelError(UserError, ValueError):
    """The model cannot be decoded incrementally by the embedded engine."""
