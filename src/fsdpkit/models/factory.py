"""Building the model a run trains: a built-in preset, a Hugging Face directory
(``model.hf``) or the user's factory (``model.factory``).

[Note: factory contract]
A factory is ``"package.module:function"``, called with no arguments (after
``torch.manual_seed(train.seed)``). It returns an ``nn.Module`` or a
``(module, loss_fn)`` pair.

- Input: ``module(tokens)`` with ``tokens`` an int64 tensor (batch, seq) on the
  training device.
- Output: the logits (batch, seq, vocab) as a tensor, or anything holding them: an
  object with a ``.logits`` attribute (a Hugging Face ``ModelOutput``), a dict with a
  ``"logits"`` key, or a tuple/list whose first element is the logits.
- ``loss_fn(module, tokens) -> scalar tensor`` receives the whole (batch, seq + 1)
  sequence; it must call ``module(...)`` itself (the FSDP root, so its hooks gather the
  parameters). The default is ``fsdpkit.loss.next_token_loss``: logits of
  ``tokens[:, :-1]`` against ``tokens[:, 1:]`` (shifted once), mean over tokens,
  ``IGNORE_INDEX`` labels skipped. How logits are found in an output:
  ``fsdpkit.loss.logits_of``.
- Chunked loss (``train.chunked_loss``, fsdpkit.loss.head): with the default
  loss, a module whose output head is a plain ``nn.Linear`` returned unchanged as the
  logits, exposed as ``get_output_embeddings()`` or ``lm_head``, trains without full
  logits; others fall back to them (``auto``) with a notice.
- Meta-device builds: build under ``fsdpkit.meta_params()`` (parameters on meta,
  buffers from the constructor) or give the module ``init_buffers()``; a run refuses a
  module with buffers on meta and neither ([Note: buffers of meta models]). Parameters
  get the model's own init, the one rule for ``fsdpkit train`` and ``fsdpkit.shard``
  (``fsdpkit.models.hf.initialize.own_initializer``): a transformers ``PreTrainedModel``
  its ``_init_weights``, any other model fsdpkit's per-parameter init
  (``param_init(name, shape, generator)`` overrides it).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdpkit.config import ModelConfig
from fsdpkit.init import Initializer
from fsdpkit.models.errors import ModelError
from fsdpkit.models.hf.directory import check_inputs, read_hf_dir
from fsdpkit.models.hf.initialize import init_weights, own_initializer
from fsdpkit.models.llama import LlamaConfig
from fsdpkit.models.presets import MOE_OVERRIDES, builtin_model, preset

OwnLoss = Callable[[nn.Module, Any], torch.Tensor]
"""A factory's own ``loss_fn(module, batch)`` (the contract: fsdpkit.loss.contract)."""


@dataclass
class BuiltModel:
    module: nn.Module
    """The model; its parameters on the meta device when it will be materialized after
    sharding (buffers may be real: [Note: buffers of meta models])."""
    loss_fn: OwnLoss | None
    """The factory's own loss of one micro-batch; None: the run's default loss
    (fsdpkit.loss.head.default_loss)."""
    llama: LlamaConfig | None
    """Shape of a built-in model (None for a user factory or an HF model)."""
    init: Initializer | None = None
    """How ``shard`` fills the parameters after materialization (None: fsdpkit's
    per-parameter init)."""
    hf: Any = None
    """The ``fsdpkit.models.hf.directory.HFSource`` of a ``model.hf`` model."""


def llama_shape(cfg: ModelConfig, *, vocab_size: int, seq_len: int) -> LlamaConfig:
    """The preset with the config's overrides; vocab from the tokenizer unless given.
    An MoE preset (fsdpkit.models.moe) takes its router loss coefficient from
    ``model.router_aux_loss_coef`` too."""
    overrides: dict[str, object] = {
        key: getattr(cfg, key)
        for key in ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "tie_embeddings")
        if getattr(cfg, key) is not None
    }
    overrides |= {f: getattr(cfg, k) for k, f in MOE_OVERRIDES.items() if getattr(cfg, k)}
    if cfg.vocab_size is not None and cfg.vocab_size < vocab_size:
        raise ModelError(
            f"model.vocab_size = {cfg.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({vocab_size}): token ids would index past the embedding. Remove model.vocab_size "
            f"or set it to at least {vocab_size}."
        )
    overrides["vocab_size"] = cfg.vocab_size or vocab_size
    try:
        base = preset(cfg.preset)
        overrides["max_seq_len"] = max(base.max_seq_len, seq_len)
        if cfg.router_aux_loss_coef is not None and hasattr(base, "router_aux_loss_coef"):
            overrides["router_aux_loss_coef"] = cfg.router_aux_loss_coef
        return preset(cfg.preset, **overrides)
    except ValueError as exc:
        raise ModelError(str(exc)) from None


def build_model(cfg: ModelConfig, *, vocab_size: int, seq_len: int, seed: int) -> BuiltModel:
    """The model of a run, before sharding: built-in Llama or MoE (on meta when
    ``cfg.meta_init``), a ``model.hf`` directory (on meta) or the user's factory model.
    No process group needed: the planner calls this too."""
    if cfg.hf:
        return _from_hf(
            cfg.hf,
            vocab_size=vocab_size,
            seq_len=seq_len,
            seed=seed,
            init_missing=cfg.init_missing,
        )
    if cfg.factory:
        return _from_factory(cfg.factory, seed=seed)
    shape = llama_shape(cfg, vocab_size=vocab_size, seq_len=seq_len)
    if cfg.meta_init:
        with torch.device("meta"):
            return BuiltModel(module=builtin_model(shape), loss_fn=None, llama=shape)

    model = builtin_model(shape)
    init_weights(model, seed=seed)
    return BuiltModel(module=model, loss_fn=None, llama=shape)


def _from_hf(
    path: str, *, vocab_size: int, seq_len: int, seed: int, init_missing: bool
) -> BuiltModel:
    from fsdpkit.models.hf import (
        construct as hf,  # here: it imports DCP, which a built-in model never needs
    )

    source = read_hf_dir(path)
    check_inputs(source, vocab_size=vocab_size, seq_len=seq_len)
    module = hf.construct(source.config)
    return BuiltModel(
        module=module,
        loss_fn=None,
        llama=None,
        init=hf.HFWeights(source, seed=seed, init_missing=init_missing),
        hf=source,
    )


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


def _from_factory(spec: str, *, seed: int) -> BuiltModel:
    torch.manual_seed(seed)  # same weights on every rank
    made = load_factory(spec)()
    module, loss_fn = made if isinstance(made, tuple) else (made, None)
    if not isinstance(module, nn.Module):
        raise ModelError(
            f"model.factory = {spec!r} returned {type(module).__name__}, not an nn.Module "
            "(or a (module, loss_fn) pair)."
        )
    built = BuiltModel(module=module, loss_fn=loss_fn, llama=None)
    if any(p.is_meta for p in module.parameters()):
        built.init = own_initializer(module, seed=seed)
    return built
