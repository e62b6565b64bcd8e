"""The loop's own resumable state: step, data position, RNG streams, grad scaler.

It is a DCP ``Stateful`` so a checkpoint saves it beside the model and optimizer, and
a resumed run continues bit-exactly (same batches, same random numbers).
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
        state: dict[str, Any] = {
            "step": self.step,
            "data": self.loader.state_dict(),
            "rng_cpu": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["rng_cuda"] = torch.cuda.get_rng_state()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.loader.load_state_dict({k: int(v) for k, v in state["data"].items()})
        torch.set_rng_state(state["rng_cpu"])
        if "rng_cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["rng_cuda"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
