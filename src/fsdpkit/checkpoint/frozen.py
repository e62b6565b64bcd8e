"""A fingerprint of the frozen base, saved with adapter-only checkpoints.

[Note: adapters need their base]
``checkpoint.adapters_only`` saves the trainable parameters and their optimizer state
only; a resume rebuilds the frozen base from the config (model.hf, model.init_from, the
seed) and loads the adapters onto it. If the base is not the one the adapters were
trained on (the directory was replaced, another seed, another lora.base_dtype) the run
would continue silently wrong. So every checkpoint of a run with frozen parameters
carries the base's fingerprint (element count, sum and sum of squares of every frozen
parameter, in float64, summed over the shards), and resuming adapters onto a base whose
fingerprint differs stops with a ``FrozenBaseMismatch``. A full checkpoint restores the
base itself, so its fingerprint is not compared. The fingerprint is independent of the
world size up to float64 rounding (compared at 1e-9 relative), and of the layout: under
pipeline parallelism a rank holds its stages' parameters only, so the stages' sums are
added over the pipeline group, the last stage's copy of a tied weight left out (the
first stage's counts it), and a pp checkpoint's adapters resume without pp and back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor, Shard

from fsdpkit.errors import UserError

_TOLERANCE = 1e-9


class FrozenBaseMismatch(UserError):
    """Adapters would be resumed onto a different frozen base."""


def _reduce(stats: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Sum ``stats`` over the mesh dimensions ``param`` is sharded on."""
    if not isinstance(param, DTensor) or not dist.is_initialized():
        return stats
    mesh = param.device_mesh
    for dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard) and mesh.size(dim) > 1:
            dist.all_reduce(stats, group=mesh.get_group(dim))
    return stats


def fingerprint(
    model: nn.Module, *, across: Any = None, skip: Sequence[torch.Tensor] = ()
) -> torch.Tensor:
    """float64 [elements, sum, sum of squares] over the frozen parameters (collective on
    a sharded model: every rank must call it). Each layout (tensor parallelism mixes
    split and replicated parameters) is summed over the mesh axes it is sharded on.
    ``across``: the pipeline group, whose ranks hold the other stages (None without
    pp); ``skip``: parameters another stage counts."""
    left_out = {id(t) for t in skip}
    frozen: list[torch.Tensor] = [
        p for p in model.parameters() if not p.requires_grad and id(p) not in left_out
    ]
    total = torch.zeros(3, dtype=torch.float64)
    for group in _by_layout(frozen):
        local = torch.zeros(3, dtype=torch.float64)
        for p in group:
            t = (p.to_local() if isinstance(p, DTensor) else p).detach().double().cpu()
            local += torch.stack(
                [torch.tensor(t.numel(), dtype=torch.float64), t.sum(), t.square().sum()]
            )
        device = group[0].device if group[0].device.type != "meta" else torch.device("cpu")
        total += _reduce(local.to(device), group[0]).cpu()
    if across is not None:
        total = total.to(_device(model))
        dist.all_reduce(total, group=across)
    return total.cpu()


def _device(model: nn.Module) -> torch.device:
    """Where the model's parameters live (a collective's tensor must be there for NCCL;
    offloaded parameters run gloo for CPU tensors too)."""
    first = next(model.parameters(), None)
    if first is None or first.device.type == "meta":
        return torch.device("cpu")
    return first.device


def _by_layout(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Parameters grouped by (mesh, placements), in first-seen order (the same on every
    rank, so the groups' collectives pair up)."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        key = (p.device_mesh, p.placements) if isinstance(p, DTensor) else None
        groups.setdefault(key, []).append(p)
    return list(groups.values())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return all(
        math.isclose(x, y, rel_tol=_TOLERANCE, abs_tol=_TOLERANCE)
        for x, y in zip(a.tolist(), b.tolist())
    )


class FrozenBase(Stateful):
    """The checkpoint entry holding the base's fingerprint ([Note: adapters need their
    base]), computed from the model at each save and load (collective); compared on
    load when ``check`` (only the adapters are loaded)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        check: bool,
        across: Any = None,
        skip: Sequence[torch.Tensor] = (),
    ) -> None:
        self.model = model
        self.check = check
        self.across = across
        """The pipeline group (``fingerprint``'s), None without pp."""
        self.skip = list(skip)
        self._now: torch.Tensor | None = None

    def state_dict(self) -> dict[str, Any]:
        self._now = fingerprint(self.model, across=self.across, skip=self.skip)
        return {"fingerprint": self._now.clone()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved, now = state_dict["fingerprint"], self._now
        if self.check and now is not None and not _same(saved, now):
            raise FrozenBaseMismatch(
                "the checkpoint's adapters were trained on a different frozen base than the "
                f"one this run built (base fingerprint {_show(saved)} saved, {_show(now)} "
                "now): the base weights come from model.hf / model.init_from / train.seed "
                "and lora.base_dtype, and one of them changed since the save. Resume with "
                "the model settings the adapters were trained with (`fsdpkit ckpt inspect "
                "CKPT` shows the saved config), or with checkpoint.adapters_only = false "
                "from a full checkpoint."
            )


def _show(t: torch.Tensor) -> str:
    n, s, sq = t.tolist()
    return f"{int(n)} elements, sum {s:.6g}, sum of squares {sq:.6g}"
