"""The modules that stand at a pipeline stage's edges in place of what another stage
holds: a skipped block, the hidden states received instead of the embedding's output,
and the hidden states sent on instead of the head's logits ([Note: stage modules] in
fsdpkit.sharding.pipeline.parts).

Their own module, below both axes that must recognize them: pipeline parallelism
builds stages of them, and tensor parallelism's plans (fsdpkit.sharding.tensor.rules)
leave a stage's ``StageInput`` / ``StageOutput`` unsplit, so tp never imports pp.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_PLAIN = (bool, int, float, str, type(None))


class SkippedBlock(nn.Module):
    """A block held by another stage ([Note: stage modules])."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        for key, value in vars(block).items():
            if not key.startswith("_") and key != "training" and isinstance(value, _PLAIN):
                self.__dict__[key] = value

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else kwargs["hidden_states"]


class StageInput(nn.Module):
    """The input embedding of a stage that receives hidden states: returns
    ``pending`` (set by the stage for each micro-batch) for the token ids it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: torch.Tensor | None = None

    def forward(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        hidden = self.pending  # under sequence parallelism: this rank's sequence shard
        if hidden is None or hidden.shape[0] != ids.shape[0] or ids.shape[1] % hidden.shape[1]:
            got = None if hidden is None else tuple(hidden.shape)
            raise RuntimeError(
                f"pipeline stage input: hidden states {got} received for token ids "
                f"{tuple(ids.shape)}; the stages disagree on the micro-batch."
            )
        return hidden


class TiedStageInput(StageInput):
    """The last stage's ``StageInput`` of a model with a tied embedding and head: holds
    the head's weight as ``weight`` (the embedding's name, as in the whole model),
    which its forward never reads."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


class TiedHeadView(nn.Module):
    """The output head in the view of a rank that holds both the first and the last
    stage of a tied model (a V schedule): holds the first stage's copy as ``weight``
    (set once the stages are sharded), so the view is a tied model and the optimizer
    steps that copy only ([Note: tied embeddings across stages]). Never run."""


class StageOutput(nn.Module):
    """The output head of a stage that sends hidden states on: returns its input and
    keeps it as ``seen``."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x
        return x
