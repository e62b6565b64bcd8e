"""Building the model a run trains: a built-in preset or the user's factory.

A factory is ``"package.module:function"``; it is called with no arguments and returns
an ``nn.Module`` mapping token ids (batch, seq) to logits (batch, seq, vocab), or a
``(module, loss_fn)`` pair where ``loss_fn(module, tokens) -> scalar loss`` replaces the
default next-token cross-entropy.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fsdpkit.config import ModelConfig
from fsdpkit.errors import UserError
from fsdpkit.models.llama import Llama, LlamaConfig, preset

LossFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]


class ModelError(UserError):
    """The model section names something that cannot be built."""


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1] (fp32 logits)."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


@dataclass
class BuiltModel:
    module: nn.Module
    """The model, on the meta device when it will be materialized after sharding."""
    loss_fn: LossFn
    """Loss of one micro-batch."""
    llama: LlamaConfig | None
    """Shape of a built-in model (None for a user factory)."""


def llama_shape(cfg: ModelConfig, *, vocab_size: int, seq_len: int) -> LlamaConfig:
    """The preset with the config's overrides; vocab from the tokenizer unless given."""
    overrides: dict[str, object] = {
        key: getattr(cfg, key)
        for key in ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "tie_embeddings")
        if getattr(cfg, key) is not None
    }
    if cfg.vocab_size is not None and cfg.vocab_size < vocab_size:
        raise ModelError(
            f"model.vocab_size = {cfg.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({vocab_size}): token ids would index past the embedding. Remove model.vocab_size "
            f"or set it to at least {vocab_size}."
        )
    overrides["vocab_size"] = cfg.vocab_size or vocab_size
    try:
        overrides["max_seq_len"] = max(preset(cfg.preset).max_seq_len, seq_len)
        return preset(cfg.preset, **overrides)
    except ValueError as exc:
        raise ModelError(str(exc)) from None


def build_model(cfg: ModelConfig, *, vocab_size: int, seq_len: int, seed: int) -> BuiltModel:
    """Built-in Llama (on meta when ``cfg.meta_init``) or the user's factory model."""
    if cfg.factory:
        module, loss_fn = _from_factory(cfg.factory, seed=seed)
        return BuiltModel(module=module, loss_fn=loss_fn, llama=None)
    shape = llama_shape(cfg, vocab_size=vocab_size, seq_len=seq_len)
    if cfg.meta_init:
        with torch.device("meta"):
            return BuiltModel(module=Llama(shape), loss_fn=next_token_loss, llama=shape)
    from fsdpkit.init import init_weights

    model = Llama(shape)
    init_weights(model, seed=seed)
    return BuiltModel(module=model, loss_fn=next_token_loss, llama=shape)


def load_factory(spec: str) -> Callable[[], object]:
    """Import ``package.module:function``; errors say which part failed."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ModelError(
            f"model.factory = {spec!r}: importing module {module_name!r} failed "
            f"({type(exc).__name__}: {exc}). Check the module path and that it is on "
            "PYTHONPATH (run from the directory containing the package)."
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ModelError(
            f"model.factory = {spec!r}: module {module_name!r} has no callable {attr!r}."
        )
    return fn


def _from_factory(spec: str, *, seed: int) -> tuple[nn.Module, LossFn]:
    torch.manual_seed(seed)  # same weights on every rank
    made = load_factory(spec)()
    module, loss_fn = made if isinstance(made, tuple) else (made, next_token_loss)
    if not isinstance(module, nn.Module):
        raise ModelError(
            f"model.factory = {spec!r} returned {type(module).__name__}, not an nn.Module "
            "(or a (module, loss_fn) pair)."
        )
    return module, loss_fn
