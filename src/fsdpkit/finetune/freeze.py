"""Which parameters train: name globs (``model.freeze``, ``lora.trainable``) and counts.

A frozen parameter has ``requires_grad = False`` before ``fully_shard``: FSDP2 then
never reduces a gradient for it, ``build_optimizer`` gives it no state, and units that
mix frozen and trainable parameters shard as usual (FSDP2 keeps one all-gather per unit
and reduce-scatters only the trainable gradients; its uniform-dtype rule covers the
trainable parameters only, so a bf16 base beside fp32 adapters is allowed).

[Note: name globs]
A pattern matches a dotted name when ``fnmatch`` matches the whole name, or the name
ends with ``.`` + a match (so ``q_proj`` matches every ``*.q_proj`` and
``embed_tokens.weight`` matches ``model.embed_tokens.weight``). ``*`` crosses dots.
Tied parameters answer to every name they are registered under.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase

from torch import nn

from fsdpkit.finetune.errors import FinetuneError


def matches(pattern: str, name: str) -> bool:
    """[Note: name globs]."""
    return fnmatchcase(name, pattern) or fnmatchcase(name, f"*.{pattern}")


def select(
    patterns: Iterable[str], names: Iterable[str], *, key: str, what: str
) -> dict[str, list[str]]:
    """``{pattern: names it matches}``; a pattern that matches nothing is an error
    naming ``key`` and a few of the ``what`` the model has."""
    names = list(names)
    out = {p: [n for n in names if matches(p, n)] for p in patterns}
    empty = [p for p, hits in out.items() if not hits]
    if empty:
        raise FinetuneError(
            f"{key}: the pattern {empty[0]!r} matches no {what} of this model, so it would "
            f"silently do nothing. {_examples(names, what=what)} Patterns are globs over "
            "the dotted names ('*' crosses dots; a bare name such as 'q_proj' matches it "
            "as a suffix). Fix or remove the pattern."
        )
    return out


def _examples(names: list[str], *, what: str) -> str:
    leaves = sorted({n.rpartition(".")[2] for n in names})
    shown = ", ".join(leaves[:12]) + (", ..." if len(leaves) > 12 else "")
    first = names[0] if names else "-"
    return f"Its {what} end in: {shown} (e.g. {first!r})."


def base_name(name: str) -> str:
    """The base model's name of a parameter of a LoRA-adapted model (peft moves a wrapped
    layer's weight to ``<layer>.base_layer.weight``)."""
    return name.replace(".base_layer.", ".")


def param_names(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every name of every parameter (tied ones under each of their names; under LoRA
    also the base model's name of each wrapped weight)."""
    named = dict(model.named_parameters(remove_duplicate=False))
    return {**{base_name(n): p for n, p in named.items()}, **named}


def set_trainable(model: nn.Module, patterns: Iterable[str], *, key: str, value: bool) -> int:
    """Set ``requires_grad = value`` on the parameters ``patterns`` match (each pattern
    must match one); returns how many tensors changed."""
    params = param_names(model)
    hits = select(patterns, params, key=key, what="parameters")
    chosen = {id(params[n]): params[n] for names in hits.values() for n in names}
    for p in chosen.values():
        p.requires_grad_(value)
    return len(chosen)


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of a model, each tensor once (tied ones counted once)."""

    trainable: int
    total: int

    @classmethod
    def of(cls, model: nn.Module) -> ParamCounts:
        params = list(model.parameters())  # deduplicated: tied counted once
        return cls(
            trainable=sum(p.numel() for p in params if p.requires_grad),
            total=sum(p.numel() for p in params),
        )

    def describe(self) -> str:
        share = 100 * self.trainable / self.total if self.total else 0.0
        return (
            f"{_count(self.trainable)} of {_count(self.total)} parameters trainable ({share:.2f}%)"
        )


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)
