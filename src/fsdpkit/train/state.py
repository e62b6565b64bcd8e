"""The loop's own resumable state: step, data position, grad scaler.

It is a DCP ``Stateful`` saved beside the model and optimizer. Everything in it is the
same on every rank (DCP stores such replicated values once); per-rank RNG streams
are saved separately under ``RankLocal`` (see fsdpkit.checkpoint.statefuls). Every value
is saved as a 0-d tensor, never a pickled object, so resuming needs no unpickler
([Note: untrusted checkpoints]).
"""

from __future__ import annotations

from typing import Any

import torch

from fsdpkit.data import Loader


class TrainerState:
    """Everything besides model/optimizer/scheduler that a resume must restore."""

    def __init__(self, *, loader: Loader, scaler: torch.amp.GradScaler | None) -> None:
        self.step = 0
        self.loader = loader
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "step": _tensor(self.step),
            "data": {k: _tensor(v) for k, v in self.loader.state_dict().items()},
        }
        if self.scaler is not None:
            state["scaler"] = {k: _tensor(v) for k, v in self.scaler.state_dict().items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(_value(state["step"]))
        self.loader.load_state_dict({k: int(_value(v)) for k, v in state["data"].items()})
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict({k: _value(v) for k, v in state["scaler"].items()})


def _tensor(value: int | float) -> torch.Tensor:
    """A number as a 0-d tensor (int64 or float64: both hold Python's values exactly)."""
    dtype = torch.float64 if isinstance(value, float) else torch.int64
    return torch.tensor(value, dtype=dtype)


def _value(value: Any) -> Any:
    """Back from ``_tensor`` (plain numbers of older checkpoints pass through)."""
    return value.item() if isinstance(value, torch.Tensor) else value
