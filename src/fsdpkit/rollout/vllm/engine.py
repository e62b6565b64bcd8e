"""The vLLM rollout engine: a vLLM engine process beside each data-parallel rank, the
policy's weights pushed into it before each rollout that follows an update.

[Note: the vLLM engine]
Colocated: each rank starts its own engine (fsdpkit.rollout.vllm.process) on its own
device, serving the rank's own prompts; an engine holds the whole model (vLLM's tensor
parallelism across a rank group is not offered: a model the engine cannot hold on one
device needs rl.engine = embedded). ``generate`` keeps the embedded engine's contract
([Note: the embedded engine]): one completion per seed, each token's log-prob under the
sampling policy, finish "stop" or "length".

The push ([Note: pushing weights to the engine]) runs when the policy changed since the
last one (``weights_updated``: the GRPO step calls it after its optimizer updates; a
new engine and an engine that slept through a level-2 sleep also need one), before the
rollout, and is collective: every rank pushes in the same step. Its seconds and bytes
are the step's ``rl/sync_s`` and ``rl/sync_bytes``. What it cannot prove by itself (the
engine computes with what the trainer holds) the step's log-prob gap checks on every
sampled token ([Note: the log-prob gap]); what it can, it checks at once: every
parameter of the engine received a tensor in this push, and every tensor arrived in
the engine's dtype (the engine refuses others by name).

Stop strings: the engine has no tokenizer (prompts and completions are token ids), so
a completion is cut after the first token at which its decoded text contains a stop
string, as the embedded engine stops there (tokens after it were sampled and are
dropped, never trained).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from fsdpkit.rollout.embedded import Completion
from fsdpkit.rollout.sampling import Sampling
from fsdpkit.rollout.vllm.process import EngineProcess, VllmEngineError
from fsdpkit.rollout.vllm.sync import Layout, weight_stream


@dataclass(frozen=True)
class Push:
    """One push's cost on this rank."""

    seconds: float
    bytes: int
    tensors: int


class VllmEngine:
    """Rollouts from this rank's vLLM engine ([Note: the vLLM engine])."""

    name = "vllm"

    def __init__(
        self,
        model: nn.Module,
        *,
        process: EngineProcess,
        plan: Layout,
        dtype: torch.dtype,
        decode: Callable[[list[int]], str],
    ) -> None:
        self.model, self.process, self.plan, self.dtype = model, process, plan, dtype
        self.decode = decode
        self.stale = True
        """Whether the engine's weights may differ from the policy's."""
        self.pushes: list[Push] = []
        """Pushes not yet reported (``sync`` reports and clears them)."""
        self.start_s = 0.0

    def wait_ready(self) -> None:
        self.start_s = self.process.wait_ready()

    def weights_updated(self) -> None:
        """The policy changed (an optimizer update): push before the next rollout."""
        self.stale = True

    def sync(self) -> dict[str, float]:
        """Push the policy's weights if the engine may hold others (collective); the
        pushes since the last call (a held-out evaluation pushes too) as metrics."""
        self._push_if_stale()
        done, self.pushes = self.pushes, []
        if not done:
            return {}
        return {
            "rl/sync_s": sum(p.seconds for p in done),
            "rl/sync_bytes": float(sum(p.bytes for p in done)),
            "rl/sync_tensors": float(sum(p.tensors for p in done)),
        }

    def _push_if_stale(self) -> None:
        if self.stale:
            self.pushes.append(self.push())
            self.stale = False

    def describe(self) -> str:
        info = self.process.info
        return (
            f"a vLLM engine per rank (vllm {info.get('vllm', '?')}, {self.process.spec.dtype}, "
            f"ready in {self.start_s:.0f} s, log {self.process.log}), its weights pushed from "
            "the shards after every update"
        )

    @torch.no_grad()
    def push(self) -> Push:
        """Stream the policy into the engine ([Note: pushing weights to the engine]);
        collective: every rank pushes to its own engine in the same step."""
        start = time.perf_counter()
        bucket, sent, tensors = self.process.bucket, 0, 0
        bucket.clear()
        self.process.call("begin")
        for name, value in self.stream():
            nbytes = value.numel() * value.element_size()
            if bucket.slots and not bucket.fits(nbytes):
                self._flush()
            bucket.put(name, value)
            sent, tensors = sent + nbytes, tensors + 1
        if bucket.slots:
            self._flush()
        missing = self.process.call("end")["missing"]
        if missing:
            raise VllmEngineError(
                f"rl.engine = 'vllm': the weight push left {len(missing)} of the engine's "
                f"parameters without a value ({', '.join(missing[:5])}"
                f"{', ...' if len(missing) > 5 else ''}): it would sample with stale "
                "weights for them, so the run stopped before the rollout. The push sends "
                "every parameter of the policy under the names save_pretrained writes; a "
                "parameter the engine's model has and the policy lacks means the engine "
                "built another architecture than the trainer's (check model.hf's "
                "config.json), or the policy was changed after the engine started."
            )
        return Push(seconds=time.perf_counter() - start, bytes=sent, tensors=tensors)

    def stream(self) -> Any:
        """The tensors a push sends (a method, so a test can wrap it)."""
        return weight_stream(self.model, self.plan, dtype=self.dtype)

    def _flush(self) -> None:
        bucket = self.process.bucket
        self.process.call("load", [s.as_tuple() for s in bucket.slots])
        bucket.clear()

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[np.ndarray],
        *,
        seeds: Sequence[Sequence[int]],
        sampling: Sampling,
    ) -> list[list[Completion]]:
        """For each prompt, one completion per seed (collective when a push is due)."""
        self._push_if_stale()
        request = {
            "prompts": [[int(t) for t in p] for p in prompts],
            "seeds": [[int(s) for s in group] for group in seeds],
            "sampling": {
                "temperature": sampling.temperature,
                "max_tokens": sampling.max_new_tokens,
                "stop_ids": sorted(sampling.stop_ids),
            },
        }
        raw = self.process.call("generate", request)
        if self.process.call("sleep"):  # CUDA sleep mode: the weights are gone
            self.stale = True
        done = [self._completion(ids, logps, finish, sampling) for ids, logps, finish in raw]
        out, i = [], 0
        for group in seeds:
            out.append(done[i : i + len(group)])
            i += len(group)
        return out

    def _completion(
        self, ids: list[int], logps: list[float], finish: str, sampling: Sampling
    ) -> Completion:
        if len(logps) != len(ids):
            raise VllmEngineError(
                f"rl.engine = 'vllm': the engine returned {len(ids)} tokens but "
                f"{len(logps)} log-probs for a completion; its log is {self.process.log}."
            )
        cut = stop_string_end(ids, sampling.stop_strings, self.decode)
        if cut is not None:
            return Completion(ids=ids[:cut], logps=logps[:cut], finish="stop")
        return Completion(ids=ids, logps=logps, finish=finish)

    def close(self) -> None:
        self.process.close()


def stop_string_end(
    ids: list[int], stops: Sequence[str], decode: Callable[[list[int]], str]
) -> int | None:
    """The length of the shortest prefix of ``ids`` whose text contains a stop string
    (the embedded engine's rule), or None."""
    if not stops or not any(s in decode(ids) for s in stops):
        return None
    for n in range(1, len(ids) + 1):
        if any(s in decode(ids[:n]) for s in stops):
            return n
    return None


def agree(error: str | None) -> None:
    """Every rank raises the first rank's engine error (collective), so no rank waits
    in a collective for one whose engine failed."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        if error:
            raise VllmEngineError(error)
        return
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise VllmEngineError(first)
