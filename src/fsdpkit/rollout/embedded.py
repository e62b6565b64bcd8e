"""The embedded rollout engine: the policy being trained samples its own completions.

[Note: the embedded engine]
No second copy of the model and no weight sync: the engine is the sharded policy
itself, so what it samples with is by construction the weights the trainer steps.
For a rollout every FSDP unit is all-gathered once (``gathered``) and kept gathered
through every forward of the rollout, then resharded: a decode step then runs no
collective, so ranks decode their own prompts independently (different completion
lengths, different numbers of forwards) without deadlock, and no all-gather is paid
per token. This needs the whole model in the compute dtype on each rank for the
rollout, beside the shards and optimizer state: ``fsdpkit plan`` counts it with the KV
cache (``rl`` rows). Each group of one prompt's G completions is one decode batch
([Note: decoding with a KV cache]); each completion draws from its own seeded stream
([Note: world-size-independent samples]).

A completion ends at a stop token (kept), when its text contains a stop string (kept),
or at ``max_new_tokens`` (truncated). The log-prob of every sampled token is kept for
the gap check ([Note: the log-prob gap]).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fsdpkit.rollout.decoding import decoder_factory
from fsdpkit.rollout.sampling import Sampling, draw, generators

FINISH = ("stop", "length")
"""Why a completion ended: a stop token or string, or max_new_tokens."""


@dataclass(frozen=True)
class Completion:
    """One sampled completion."""

    ids: list[int]
    logps: list[float]
    """Each token's log-prob under the sampling policy (temperature applied, before
    top-k / top-p: [Note: world-size-independent samples])."""
    finish: str
    """"stop" or "length" (truncated)."""

    @property
    def truncated(self) -> bool:
        return self.finish == "length"


class RolloutEngine(Protocol):
    """What the GRPO step samples from: the embedded engine, or vLLM's
    (fsdpkit.rollout.vllm.engine)."""

    name: str

    def generate(
        self,
        prompts: Sequence[np.ndarray],
        *,
        seeds: Sequence[Sequence[int]],
        sampling: Sampling,
    ) -> list[list[Completion]]: ...

    def sync(self) -> dict[str, float]:
        """Bring the engine's weights to the policy's if they may differ (collective);
        the cost as metrics."""
        ...

    def weights_updated(self) -> None:
        """The policy changed (after the optimizer updates of a step)."""

    def describe(self) -> str: ...

    def close(self) -> None: ...


@contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Within, every FSDP unit of ``model`` holds its whole parameters and keeps them
    across forwards ([Note: the embedded engine]); collective on entry and exit (every
    rank of the mesh, in the same order). FSDP2 reshards a unit after each forward
    unless its param group has no post-forward mesh: that is set to None here (what
    ``set_reshard_after_forward(False)`` sets, without touching the root's automatic
    choice) and restored on exit."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    groups = [_param_group(u) for u in units]
    saved = [g.post_forward_mesh_info if g is not None else None for g in groups]
    for group in groups:
        if group is not None:
            group.post_forward_mesh_info = None
    try:
        handles = [u.unshard(async_op=True) for u in units]
        for handle in handles:
            if handle is not None:
                handle.wait()
        yield
    finally:
        for group, info in zip(groups, saved):
            if group is not None:
                group.post_forward_mesh_info = info
        for unit in units:
            unit.reshard()


def _param_group(unit: FSDPModule) -> Any:
    """The unit's FSDP2 parameter group (None for a unit that holds no parameter)."""
    return unit._get_fsdp_state()._fsdp_param_group


class EmbeddedEngine:
    """Rollouts from ``model`` (the FSDP root of the policy) on ``device``."""

    name = "embedded"

    def __init__(
        self, model: nn.Module, *, device: torch.device, decode: Callable[[list[int]], str]
    ) -> None:
        """``decode``: completion ids -> text, to find stop strings."""
        self.model, self.device, self.decode = model, device, decode
        self._decoder = decoder_factory(model)

    def sync(self) -> dict[str, float]:
        """Nothing to bring over: the engine is the policy."""
        return {}

    def weights_updated(self) -> None:
        pass

    def describe(self) -> str:
        return "the embedded engine (the policy, gathered whole per rollout)"

    def close(self) -> None:
        pass

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[np.ndarray],
        *,
        seeds: Sequence[Sequence[int]],
        sampling: Sampling,
    ) -> list[list[Completion]]:
        """For each prompt, one completion per seed (collective: every rank calls it,
        with prompts of its own)."""
        was_training = self.model.training
        self.model.eval()
        try:
            with gathered(self.model):
                return [self._group(p, s, sampling) for p, s in zip(prompts, seeds)]
        finally:
            self.model.train(was_training)

    def _group(
        self, prompt: np.ndarray, seeds: Sequence[int], sampling: Sampling
    ) -> list[Completion]:
        """One prompt's completions, decoded as one batch."""
        rows = len(seeds)
        ids = torch.as_tensor(np.asarray(prompt, dtype=np.int64), device=self.device)
        streams = generators(seeds, device=self.device)
        out = _Group(rows)
        with self._decoder() as decoder:
            logits = decoder.prefill(ids.unsqueeze(0).expand(rows, -1).contiguous())
            for _ in range(sampling.max_new_tokens):
                live = out.live()
                scaled = logits[live].float() / sampling.temperature
                tokens, logps = draw(scaled, sampling=sampling, streams=[streams[i] for i in live])
                out.add(live, tokens.tolist(), logps.tolist(), sampling=sampling, text=self.decode)
                if not out.live():
                    break
                feed = torch.as_tensor([seq[-1] for seq in out.ids], device=self.device)
                logits = decoder.step(feed)
        return out.completions()


class _Group:
    """The completions of one decode batch as they grow."""

    def __init__(self, rows: int) -> None:
        self.ids: list[list[int]] = [[] for _ in range(rows)]
        self.logps: list[list[float]] = [[] for _ in range(rows)]
        self.done = [False] * rows

    def live(self) -> list[int]:
        return [i for i, done in enumerate(self.done) if not done]

    def add(
        self,
        rows: list[int],
        tokens: list[int],
        logps: list[float],
        *,
        sampling: Sampling,
        text: Callable[[list[int]], str],
    ) -> None:
        for row, token, logp in zip(rows, tokens, logps):
            self.ids[row].append(token)
            self.logps[row].append(logp)
            if token in sampling.stop_ids or (
                sampling.stop_strings
                and any(s in text(self.ids[row]) for s in sampling.stop_strings)
            ):
                self.done[row] = True

    def completions(self) -> list[Completion]:
        return [
            Completion(ids=i, logps=lp, finish="stop" if done else "length")
            for i, lp, done in zip(self.ids, self.logps, self.done)
        ]
