"""A Hugging Face model's own initialization (``_init_weights``), on sharded parameters,
and the one init rule every way into fsdpkit follows (``own_initializer``: ``shard``,
``fsdpkit train``, and ``init_weights``, exported as ``fsdpkit.init_weights``).

[Note: HF init on shards]
transformers initializes a model by calling ``_init_weights(module)`` on every module,
children before parents, with the global RNG. On a sharded model that cannot run as
is: DTensor's CPU RNG gives every shard the same draws (see the cpu-fsdp-facts traps),
and the draws would depend on the world size. Instead, for each module that owns
parameters to initialize, a *shadow* of the model (the same architecture with its
parameters on meta) gets real CPU tensors for just those parameters; ``_init_weights``
runs on that module and then on each of its ancestors (the only modules whose init can
reach them; GPT-2's attention re-draws its child ``c_proj``), each call seeded from
(seed, module name); each rank keeps its own slice (``copy_full_value``). The result:

- the model's own distributions (GPT-2's scaled residual projections, Gemma's
  zero-centred norms, zeroed padding rows), not fsdpkit's defaults;
- deterministic from the seed and identical at any world size, sharded or not;
- at most one module's parameters in full on the CPU at a time;
- writes to every other tensor land on meta and vanish, so weights loaded from a
  checkpoint are never touched.

Meta buffers of a model built entirely on meta get their values the same way, before
sharding (``recreate_hf_buffers``): in transformers 5 ``_init_weights`` re-creates
RoPE tables and embedding scales, exactly as ``from_pretrained`` relies on.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import nn

from fsdpkit.init import Initializer, copy_full_value, param_seed, run_init
from fsdpkit.models.buffers import meta_buffers, stamp, unchanged
from fsdpkit.pretrained import is_hf_model


def _chain(root: nn.Module, path: str) -> list[tuple[str, nn.Module, nn.Module | None]]:
    """(path, module, its HF init owner) from ``root`` down to ``path``; the owner is the
    nearest enclosing PreTrainedModel, as transformers' ``smart_apply`` dispatches."""
    out: list[tuple[str, nn.Module, nn.Module | None]] = []
    owner: nn.Module | None = root if is_hf_model(root) else None
    module, prefix = root, ""
    out.append(("", root, owner))
    for part in path.split(".") if path else []:
        module = module.get_submodule(part)
        prefix = f"{prefix}.{part}" if prefix else part
        owner = module if is_hf_model(module) else owner
        out.append((prefix, module, owner))
    return out


def _run_inits(root: nn.Module, path: str, *, seed: int) -> None:
    """``_init_weights`` on the module at ``path`` and then its ancestors, each seeded
    by its own name ([Note: HF init on shards])."""
    for prefix, module, owner in reversed(_chain(root, path)):
        if owner is not None:
            torch.manual_seed(param_seed(seed, f"hf-init:{prefix}"))
            owner._init_weights(module)  # type: ignore[operator]


def _owner_values(
    shadow: nn.Module, path: str, names: list[str], *, seed: int
) -> dict[str, torch.Tensor]:
    """Full initial values of the parameters ``names`` of the shadow's module ``path``."""
    module = shadow.get_submodule(path)
    saved = {n: module._parameters[n] for n in names}
    try:
        for n, meta in saved.items():
            assert meta is not None
            module._parameters[n] = nn.Parameter(
                torch.empty(meta.shape, dtype=meta.dtype), requires_grad=meta.requires_grad
            )
        _run_inits(shadow, path, seed=seed)
        return {n: module._parameters[n].detach() for n in names}  # type: ignore[union-attr]
    finally:
        module._parameters.update(saved)


def init_like_hf(model: nn.Module, *, shadow: nn.Module, names: Iterable[str], seed: int) -> None:
    """Initialize the parameters ``names`` of ``model`` (sharded or not) with the HF
    model's own ``_init_weights``, computed on ``shadow`` (same architecture, parameters
    on meta). See [Note: HF init on shards]."""
    params = dict(model.named_parameters())
    by_module: dict[str, list[str]] = defaultdict(list)
    for name in names:
        path, _, local = name.rpartition(".")
        by_module[path].append(local)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        for path, locals_ in by_module.items():
            values = _owner_values(shadow, path, locals_, seed=seed)
            for local, value in values.items():
                copy_full_value(params[f"{path}.{local}" if path else local], value)


def recreate_hf_buffers(model: nn.Module, *, seed: int) -> list[str]:
    """Give the meta buffers of a meta-built HF model the values its ``_init_weights``
    computes (before sharding: the parameters are on meta, so nothing else is written).
    Returns the buffers it could not re-create (left on meta)."""
    by_module: dict[str, list[str]] = defaultdict(list)
    for name, buf in model.named_buffers():
        if buf.is_meta:
            path, _, local = name.rpartition(".")
            by_module[path].append(local)
    left = []
    # explicit CPU: a caller may build under torch.device("meta") (the doctor does)
    with torch.random.fork_rng(devices=[]), torch.no_grad(), torch.device("cpu"):
        for path, locals_ in by_module.items():
            module = model.get_submodule(path)
            metas = {n: module._buffers[n] for n in locals_}
            for n, meta in metas.items():
                assert meta is not None
                module._buffers[n] = torch.empty_like(meta, device="cpu")
            before = {n: stamp(module._buffers[n]) for n in locals_}
            _run_inits(model, path, seed=seed)
            for n in locals_:
                if unchanged(module._buffers[n], before[n]):
                    module._buffers[n] = metas[n]
                    left.append(f"{path}.{n}" if path else n)
    return left


def own_initializer(module: nn.Module, *, seed: int) -> Initializer | None:
    """The model's own init for a meta-built model, the one rule for ``fsdpkit train``
    (``model.factory``, ``model.hf``'s missing weights) and ``fsdpkit.shard``: a
    transformers ``PreTrainedModel`` gets its ``_init_weights`` ([Note: HF init on
    shards]; its meta buffers re-created now, before sharding), any other model None
    (fsdpkit's per-parameter init, [Note: per-parameter init]). Transformers' own
    distributions are what ``from_config`` gives the same model, so a model initializes
    the same whichever way fsdpkit is entered."""
    if not is_hf_model(module):
        return None
    if meta_buffers(module):
        recreate_hf_buffers(module, seed=seed)  # what is left is refused by the caller
    shadow = meta_shadow(module)

    def init(model: nn.Module) -> None:
        names = [n for n, _ in model.named_parameters()]
        init_like_hf(model, shadow=shadow, names=names, seed=seed)

    return init


def meta_shadow(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with every parameter on meta (ties kept: the copy maps each
    parameter object once), so a materialized model's shadow costs no parameter memory."""
    memo: dict[int, object] = {
        id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for p in module.parameters()
    }
    return copy.deepcopy(module, memo)


def init_weights(model: nn.Module, *, seed: int) -> None:
    """Initialize a model built on the CPU (not yet sharded) in place with the one init rule
    of ``fsdpkit.shard`` and ``fsdpkit train`` (``own_initializer``): a transformers
    ``PreTrainedModel`` its own ``_init_weights`` ([Note: HF init on shards]), any other
    model fsdpkit's per-parameter init ([Note: per-parameter init]); then the model's
    ``init_buffers()`` hook. The values equal what ``fsdpkit.shard`` gives the same model
    built on the meta device with ``train.seed = seed``, at any world size: a script that
    builds on the CPU and one that builds on meta train the same model."""
    init = own_initializer(model, seed=seed)
    run_init(model, init=init, seed=seed)
