"""A pipeline stage as the model's own module with the other stages' parts taken out,
so every parameter keeps its name (checkpoints, HF weights and init see the model's
own FQNs at any pp degree).

[Note: stage modules]
Each stage is a shallow copy of the meta-built model along the paths to what changes
(the containers of the blocks, the parents of the embedding, final norm and head);
every block, the embedding, norm and head are the very module objects of the model,
shared by nothing else once the model is dropped. In a stage:

- a block of another stage is a ``SkippedBlock``: no parameters, returns its hidden
  states unchanged, and carries the block's plain attributes (``attention_type``,
  ``layer_idx``), so the model's own loop (``for i, layer in enumerate(self.layers)``,
  per-layer masks by ``config.layer_types[i]``) runs unchanged with the real blocks at
  their own indices;
- on every stage but the first the input embedding is a ``StageInput``: it returns the
  hidden states received from the previous stage, in the shape the embedding's output
  would have; on the last stage of a model whose head is tied to its embedding, a
  ``TiedStageInput`` that also holds the tied weight under the embedding's name, so
  that stage is a tied model too (its copy of the weight: [Note: tied embeddings
  across stages] in fsdpkit.sharding.pipeline.tied);
- on every stage but the last the final norm is ``nn.Identity`` and the output head a
  ``StageOutput``, which records its input: the stage's output is the hidden state the
  head would have read.

So a stage runs the model's own forward, with the run's own loss call (token ids,
positions, a context-parallel slice: fsdpkit.sharding.pipeline.stages). ``stage_parts``
refuses a model whose parameters lie outside its blocks, embedding, final norm and
head (no stage could own them). The boundary rule (the first block's input is what
the embedding returned; the head reads what the last block returned) is checked
while the stage runs ([Note: stage boundaries] in fsdpkit.sharding.pipeline.stages).

The rank's ``view`` is the same kind of copy holding every stage of the rank (one
stage: that stage's module itself): the optimizer, clipping and checkpoints see the
rank's parameters under the model's names through it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from fsdpkit.errors import ConfigError
from fsdpkit.models.accessors import input_embeddings, is_norm, output_embeddings
from fsdpkit.sharding.stage_edges import (
    SkippedBlock,
    StageInput,
    StageOutput,
    TiedStageInput,
)


@dataclass(frozen=True)
class ModelEnds:
    """Where the model keeps what the first and last stages hold, as module paths."""

    embedding: str
    norm: str | None
    head: str
    blocks: tuple[str, ...]
    """Every block's path, in forward order."""
    tied: bool = False
    """The embedding and the head share their weight."""


def model_ends(model: nn.Module, *, blocks: Sequence[nn.Module]) -> ModelEnds:
    """The embedding, final norm, head and blocks of ``model`` (HF's accessors, else the
    one ``nn.Embedding`` and the one ``nn.Linear`` outside the blocks); ConfigError when
    a pipeline cannot split it (no embedding or head, parameters outside them)."""
    names = {id(m): n for n, m in model.named_modules()}
    embedding = input_embeddings(model) or _only(model, nn.Embedding, outside=blocks)
    head = output_embeddings(model) or _only(model, nn.Linear, outside=blocks)
    if embedding is None or head is None or not blocks:
        raise ConfigError(
            f"parallel.pp: {type(model).__name__} has no detectable input embedding "
            "(get_input_embeddings), output head (get_output_embeddings / lm_head) or "
            "repeated blocks, so it cannot be cut into pipeline stages. Use parallel.pp = 1."
        )
    shared = {id(p) for p in embedding.parameters()} & {id(p) for p in head.parameters()}
    if shared and not _tied_weight(embedding, head):
        raise ConfigError(
            f"parallel.pp: {type(model).__name__}'s input embedding and output head share "
            "parameters other than one weight, which fsdpkit cannot give both the first "
            "and the last stage. Use parallel.pp = 1 for this model."
        )
    inside = [*blocks, embedding, head]
    covered = {id(m) for unit in inside for m in unit.modules()}
    norms = [m for m in model.modules() if id(m) not in covered and is_norm(m)]
    norm = norms[0] if len(norms) == 1 else None
    _refuse_loose(model, [*inside, *([norm] if norm is not None else [])])
    return ModelEnds(
        embedding=names[id(embedding)],
        norm=names[id(norm)] if norm is not None else None,
        head=names[id(head)],
        blocks=tuple(names[id(b)] for b in blocks),
        tied=bool(shared),
    )


def _tied_weight(embedding: nn.Module, head: nn.Module) -> bool:
    """The two share exactly one parameter, both modules' ``weight``."""
    weight = getattr(embedding, "weight", None)
    shared = {id(p) for p in embedding.parameters()} & {id(p) for p in head.parameters()}
    return weight is not None and getattr(head, "weight", None) is weight and shared == {id(weight)}


def _only(model: nn.Module, kind: type, *, outside: Sequence[nn.Module]) -> nn.Module | None:
    """The one module of ``kind`` outside the blocks (a factory model without HF's
    accessors: its embedding, its head), or None."""
    inside = {id(m) for b in outside for m in b.modules()}
    found = [m for m in model.modules() if isinstance(m, kind) and id(m) not in inside]
    return found[0] if len(found) == 1 else None


def _refuse_loose(model: nn.Module, owners: Sequence[nn.Module]) -> None:
    owned = {id(p) for m in owners for p in m.parameters()}
    loose = [n for n, p in model.named_parameters() if id(p) not in owned]
    if loose:
        raise ConfigError(
            f"parallel.pp: {type(model).__name__} has parameters outside its blocks, input "
            f"embedding, final norm and output head ({', '.join(loose[:3])}), which no "
            "pipeline stage could own. Use parallel.pp = 1 for this model."
        )


def stage_module(
    model: nn.Module,
    ends: ModelEnds,
    *,
    keep: set[int],
    first: bool,
    last: bool,
    entry: nn.Module | None = None,
    head: nn.Module | None = None,
) -> nn.Module:
    """The stage holding blocks ``keep`` ([Note: stage modules]); ``first`` / ``last``:
    whether it holds the embedding / the norm and head; ``entry``: the stage input to
    use (a rank's view shares its last stage's ``TiedStageInput``); ``head``: the head
    to use (a ``TiedHeadView``)."""
    swap: dict[str, nn.Module] = {
        path: SkippedBlock(model.get_submodule(path))
        for i, path in enumerate(ends.blocks)
        if i not in keep
    }
    if not first and entry is not None:
        swap[ends.embedding] = entry
    elif not first:
        weight = model.get_submodule(ends.embedding).weight if ends.tied and last else None
        if isinstance(weight, nn.Parameter):
            swap[ends.embedding] = TiedStageInput(weight)
        else:
            swap[ends.embedding] = StageInput()
    if head is not None:
        swap[ends.head] = head
    if not last:
        swap[ends.head] = StageOutput()
        if ends.norm is not None:
            swap[ends.norm] = nn.Identity()
    return _rebuilt(model, "", swap)


def _rebuilt(module: nn.Module, prefix: str, swap: dict[str, nn.Module]) -> nn.Module:
    """``module`` with the submodules at ``swap``'s paths replaced; modules on the way
    are shallow copies with their own dicts, the rest shared."""
    below = [p for p in swap if not prefix or p.startswith(prefix + ".")]
    if not below:
        return module
    clone = copy.copy(module)
    for key, value in vars(module).items():  # hooks, parameters, buffers: copies
        if isinstance(value, dict | set):
            clone.__dict__[key] = copy.copy(value)
    for name, child in module._modules.items():
        path = f"{prefix}.{name}" if prefix else name
        if path in swap:
            clone._modules[name] = swap[path]
        elif child is not None:
            clone._modules[name] = _rebuilt(child, path, swap)
    return clone
