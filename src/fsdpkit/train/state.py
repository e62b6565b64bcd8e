"""The loop's own resumable state: step, data position, grad scaler.

It is a DCP ``Stateful`` saved beside the model and optimizer. Everything in it is the
same on every rank (DCP stores such replicated values once); per-rank RNG streams
are saved separately under ``RankLocal`` (see fsdpkit.checkpoint.state).
"""

from __future__ import annotations

from typing import Any

import torch

from fsdpkit.data import PackedLoader


class TrainerState:
    """Everything besides model/optimizer/scheduler that a resume must restore."""

    def __init__(self, *, loader: PackedLoader, scaler: torch.amp.GradScaler | None) -> None:
        self.step = 0
        self.loader = loader
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"step": self.step, "data": self.loader.state_dict()}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.loader.load_state_dict({k: int(v) for k, v in state["data"].items()})
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
