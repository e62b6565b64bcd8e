"""What goes into a checkpoint: Stateful adapters for the model, optimizer and RNGs.

DCP calls ``state_dict()`` on each ``Stateful`` value at save time and
``load_state_dict()`` after loading into the dict that ``state_dict()`` returned, so
these adapters are all the loop needs to put in the ``state`` dict.

[Note: rank-local state]
DCP treats every non-DTensor value with the same key on every rank as replicated and
writes only one rank's copy (measured: after a 2-rank save, both ranks load rank 1's
bytes). State that differs per rank (RNG streams) must therefore live under a
rank-specific key: wrap it in ``RankLocal``. Loading at a larger world size finds no
entry for the new ranks; the Checkpointer then skips that entry for every rank (with a
warning) rather than restoring mismatched streams.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from fsdpkit.checkpoint.errors import CheckpointError

MODEL_KEY = "model"
OPTIM_KEY = "optim"


_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{alias: name}`` for parameters registered under several names (a tied head:
    ``{"lm_head.weight": "model.embed_tokens.weight"}``), with state-dict style names.

    [Note: tied weights]
    ``get_model_state_dict`` returns a tied parameter under every name as distinct
    tensor objects, and DCP would store each (an extra vocab x dim matrix per checkpoint:
    ~1 GB for Llama-3.2-1B in fp32). ``ModelOptimizerState`` saves only the first name
    and restores the aliases on load; the optimizer holds the state once anyway."""
    first: dict[int, str] = {}
    out = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        for wrapper in _WRAPPERS:
            name = name.replace(wrapper, "")
        if id(param) in first:
            out[name] = first[id(param)]
        else:
            first[id(param)] = name
    return out


def state_info(state: dict[str, Any]) -> dict[str, Any]:
    """Facts about ``state``'s layout that offline tools need (export finds the model)."""
    model = [k for k, v in state.items() if isinstance(v, ModelOptimizerState)]
    return {
        "keys": sorted(state),
        "model_prefix": f"{model[0]}.{MODEL_KEY}." if model else None,
        "tied": state[model[0]].whole_tied() if model else {},
        "rank_local": sorted(k for k, v in state.items() if isinstance(v, RankLocal)),
        "trainable_only": bool(model and state[model[0]].trainable_only),
    }


class ModelOptimizerState(Stateful):
    """Model + optimizer via get_state_dict/set_state_dict (sharded, any world size).

    Saved keys are ``model.<fqn>`` (the module's own names, e.g. HF Llama names; tied
    aliases once, see [Note: tied weights]) and ``optim.state.<fqn>.<exp_avg|...>`` /
    ``optim.param_groups...``; DCP reshards on load.

    [Note: optimizer groups across stages]
    ``optim.param_groups.<i>.params`` lists the names of group ``i``'s parameters, a
    value DCP stores once (one rank's copy: [Note: rank-local state]). A pipeline rank
    holds only its stages' parameters, so its list is not the other ranks', and a load
    at another layout would find its parameters in no group of the stored copy (their
    groups left without ``lr`` or ``betas``). With ``group_names`` (the whole model's
    names per group, fsdpkit.trainable.optim.group_names) every rank saves the whole
    model's lists, which are what a run without pp saves too; loading matches each
    parameter by name, so a checkpoint moves between any pp degrees and none.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        trainable_only: bool = False,
        group_names: list[list[str]] | None = None,
        tied: dict[str, str] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.trainable_only = trainable_only
        """Only parameters with ``requires_grad`` (``checkpoint.adapters_only``): the
        frozen base is left out on save and left as it is on load."""
        self.group_names = group_names
        """The whole model's parameter names per optimizer group, where ``model`` holds
        only some of them (a pipeline rank: [Note: optimizer groups across stages])."""
        self.tied = tied
        """The whole model's tied aliases where ``model`` holds part of it (a pipeline
        rank), for the checkpoint's record (export restores them)."""

    def whole_tied(self) -> dict[str, str]:
        """The whole model's tied aliases ([Note: tied weights])."""
        return tied_aliases(self.model) if self.tied is None else dict(self.tied)

    def _options(self) -> StateDictOptions:
        return StateDictOptions(
            ignore_frozen_params=self.trainable_only, strict=not self.trainable_only
        )

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            model_sd = get_model_state_dict(self.model, options=self._options())
            out: dict[str, Any] = {MODEL_KEY: model_sd}
        else:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options())
            if self.group_names is not None:
                _whole_groups(optim_sd, self.group_names)
            out = {MODEL_KEY: model_sd, OPTIM_KEY: optim_sd}
        for alias in tied_aliases(self.model):
            model_sd.pop(alias, None)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        model_sd = dict(state_dict[MODEL_KEY])
        for alias, name in tied_aliases(self.model).items():
            if name in model_sd:
                model_sd.setdefault(alias, model_sd[name])
        if self.optimizer is None:
            set_model_state_dict(self.model, model_sd, options=self._options())
            return
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=model_sd,
            optim_state_dict=state_dict[OPTIM_KEY],
            options=self._options(),
        )


def _whole_groups(optim_sd: dict[str, Any], names: list[list[str]]) -> None:
    """Each group's ``params`` as the whole model's names ([Note: optimizer groups
    across stages])."""
    groups = optim_sd["param_groups"]
    if len(groups) != len(names):
        raise CheckpointError(
            f"this rank's optimizer has {len(groups)} parameter groups, the model's "
            f"{len(names)}: a pipeline stage without parameters of some group cannot "
            "save a checkpoint other layouts load."
        )
    for group, whole in zip(groups, names):
        group["params"] = list(whole)


class RankLocal(Stateful):
    """Keeps ``inner``'s state under this rank's own key ([Note: rank-local state])."""

    def __init__(self, inner: Stateful, *, rank: int | None = None) -> None:
        self.inner = inner
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = rank

    @property
    def key(self) -> str:
        return f"rank{self.rank}"

    def state_dict(self) -> dict[str, Any]:
        return {self.key: self.inner.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict[self.key])


class RNGState(Stateful):
    """This process's Python, NumPy, torch CPU (and CUDA) generator states, as tensors.

    Tensors, not pickled objects, so a checkpoint never needs an unpickler to restore
    them ([Note: untrusted checkpoints]). Wrap in ``RankLocal`` when ranks draw
    different streams (dropout, sampling)."""

    def state_dict(self) -> dict[str, Any]:
        version, words, gauss = random.getstate()
        _, keys, pos, has_gauss, cached = np.random.get_state()
        out: dict[str, Any] = {
            "python": torch.tensor([version, *words], dtype=torch.int64),
            "python_gauss": torch.tensor(
                [0.0 if gauss is None else 1.0, gauss or 0.0], dtype=torch.float64
            ),
            "numpy": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "numpy_pos": torch.tensor([pos, has_gauss], dtype=torch.int64),
            "numpy_gauss": torch.tensor(cached, dtype=torch.float64),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            out["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        words = [int(w) for w in state_dict["python"].tolist()]
        has, gauss = state_dict["python_gauss"].tolist()
        random.setstate((words[0], tuple(words[1:]), gauss if has else None))
        pos, has_gauss = (int(v) for v in state_dict["numpy_pos"].tolist())
        keys = state_dict["numpy"].numpy().astype(np.uint32)
        cached = float(state_dict["numpy_gauss"].item())
        np.random.set_state(("MT19937", keys, pos, has_gauss, cached))
        torch.set_rng_state(state_dict["torch"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(state_dict["cuda"].unbind(0)))


EMBED_KEY = "model.embed_tokens.weight"
"""The input embedding's name in HF-named models: finds the model's weights in
checkpoints that predate the recorded ``model_prefix``."""


def model_prefix(meta: dict[str, Any], keys: list[str]) -> str:
    """Prefix of the model's weights among the checkpoint keys (e.g. ``app.model.``)."""
    prefix = meta.get("state", {}).get("model_prefix")
    if prefix:
        return str(prefix)
    for key in keys:
        if key.endswith(EMBED_KEY):
            return key[: -len(EMBED_KEY)]
    raise CheckpointError(
        "cannot find the model's weights in this checkpoint (no ModelOptimizerState "
        "recorded and no *.model.embed_tokens.weight key)."
    )
