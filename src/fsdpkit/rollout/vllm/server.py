"""The vLLM engine process: one per data-parallel rank, started by the trainer
(fsdpkit.rollout.vllm.process) and driven over the engine wire ([Note: the engine
wire]). Runs in the Python environment that has vLLM (``rl.vllm_python``), so it
imports only the standard library, torch, vLLM and the two fsdpkit modules that need
nothing else (wire, runtime.lifetime)::

    python -m fsdpkit.rollout.vllm.server --channel FD --bucket FD --bucket-bytes N --parent PID

[Note: the vLLM engine process]
vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no engine-core
child), so its model is reachable through ``LLM.collective_rpc`` and the process has
no children to orphan. It is built with dummy weights (``load_format = "dummy"``):
nothing is read from disk, and the trainer's first push is what makes the engine the
policy (a resumed run, LoRA, a built-in model: the same path). Start ends with a
one-token warm-up generation, so a model vLLM cannot run (e.g. a head_dim its CPU
attention lacks) fails the start, not the first rollout.

A push is ``begin`` (vLLM's layerwise reload: each layer's kernel tensors are kept, the
layer is re-created and processed again once all its checkpoint tensors arrived, so a
CPU-repacked or quantized layer loads checkpoint-layout tensors), one ``load`` per
bucket (each tensor copied out of the shared bucket first: a layer buffers its tensors
until complete, and the bucket is reused), and ``end``: the layers finalized, the
parameters that received nothing reported, and the prefix cache dropped (its KV
blocks were computed with the old weights). Samples are drawn with one vLLM seed per
completion, ending at the run's stop ids only (``ignore_eos``: the config's EOS is
among them when it is the run's; vLLM adds nothing of its own); each sampled token's
log-prob is vLLM's ``processed_logprobs``
(temperature applied; top-k / top-p are refused with this engine by
fsdpkit.config.rl), the quantity of [Note: world-size-independent samples]. On CUDA
with sleep mode the engine sleeps (level 2: weights and KV cache freed) after each
rollout and wakes the weights for the next push, then the KV cache.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

from fsdpkit.rollout.vllm.wire import DTYPES, EngineGone, SharedBucket, Slot, recv, send
from fsdpkit.runtime.lifetime import bind_to_parent


def _begin(worker: Any) -> None:
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(worker.model_runner.get_model())


def _load(worker: Any, tensors: list[tuple[str, Any]]) -> list[str]:
    return sorted(worker.model_runner.get_model().load_weights(iter(tensors)))


def _end(worker: Any) -> list[str]:
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    model = worker.model_runner.get_model()
    finalize_layerwise_reload(model, worker.model_runner.model_config)
    return sorted(name for name, _ in model.named_parameters())


class Server:
    """The engine: a vLLM ``LLM`` and this process's view of the shared bucket."""

    def __init__(self, spec: dict[str, Any], bucket: SharedBucket) -> None:
        from vllm import LLM

        self.spec, self.bucket = spec, bucket
        self.sleep_mode = bool(spec["sleep_mode"])
        self.asleep = False
        self.loaded: set[str] = set()
        self.llm = LLM(
            model=spec["model"],
            skip_tokenizer_init=True,
            load_format="dummy",
            dtype=spec["dtype"],
            enforce_eager=spec["enforce_eager"],
            logprobs_mode="processed_logprobs",
            generation_config="vllm",  # our sampling settings, not the model's defaults
            max_model_len=spec["max_model_len"],
            kv_cache_memory_bytes=spec["kv_cache_bytes"],
            enable_sleep_mode=self.sleep_mode,
            seed=0,
        )
        self.generate({"prompts": [[0]], "seeds": [[0]], "sampling": _WARM_UP})

    def begin(self, _: Any) -> None:
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc(_begin)
        self.loaded = set()

    def load(self, slots: list[tuple[str, str, tuple[int, ...], int]]) -> int:
        want = self.spec["dtype"]
        tensors = []
        for raw in slots:
            slot = Slot(*raw)
            if slot.dtype != want:
                raise TypeError(
                    f"the push sent {slot.name} as {slot.dtype}, but the engine runs in "
                    f"{want}: every tensor must arrive in the engine's dtype"
                )
            tensors.append((slot.name, self.bucket.view(slot).clone()))
        names = self.llm.collective_rpc(_load, args=(tensors,))[0]
        self.loaded.update(names)
        return len(tensors)

    def end(self, _: Any) -> dict[str, Any]:
        params = self.llm.collective_rpc(_end)[0]
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()
        return {"missing": sorted(set(params) - self.loaded)}

    def generate(self, request: dict[str, Any]) -> list[tuple[list[int], list[float], str]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        s = request["sampling"]
        prompts, params = [], []
        for ids, seeds in zip(request["prompts"], request["seeds"]):
            for seed in seeds:
                prompts.append(TokensPrompt(prompt_token_ids=list(ids)))
                params.append(
                    SamplingParams(
                        n=1,
                        temperature=s["temperature"],
                        max_tokens=s["max_tokens"],
                        stop_token_ids=list(s["stop_ids"]) or None,
                        ignore_eos=True,  # the stop ids are the run's, EOS among them
                        logprobs=0,
                        seed=seed,
                        detokenize=False,
                    )
                )
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        done = []
        for out in outs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            logps = [float(pos[t].logprob) for pos, t in zip(c.logprobs or [], ids)]
            done.append((ids, logps, "stop" if c.finish_reason == "stop" else "length"))
        return done

    def sleep(self, _: Any) -> bool:
        """Free the weights and KV cache until the next push (CUDA sleep mode)."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True
        return self.asleep


_WARM_UP = {"temperature": 1.0, "max_tokens": 2, "stop_ids": []}


def failure(where: str, exc: BaseException) -> dict[str, Any]:
    """What the trainer needs to say why the engine failed, as builtins."""
    message = str(exc).strip().splitlines()
    return {
        "where": where,
        "type": type(exc).__name__,
        "message": " ".join(message)[:2000],
        "hint": _hint(" ".join(message)),
        "traceback": "".join(traceback.format_exception(exc))[-8000:],
    }


def _hint(message: str) -> str | None:
    """vLLM's own facts about a known refusal (the supported list from vLLM itself)."""
    if "Unsupported CPU attention configuration" in message:
        try:
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            sizes = ", ".join(map(str, CPUAttentionBackend.get_supported_head_sizes()))
        except Exception:  # the hint is a courtesy: the message stands without it
            return None
        return f"vLLM's CPU attention supports head_dim {sizes} only"
    return None


def serve(sock: socket.socket, server: Server) -> int:
    """Answer requests until ``close`` or EOF (the trainer is gone)."""
    handlers: dict[str, Callable[[Any], Any]] = {
        "begin": server.begin,
        "load": server.load,
        "end": server.end,
        "generate": server.generate,
        "sleep": server.sleep,
    }
    while True:
        try:
            kind, payload = recv(sock)
        except EngineGone:
            return 0
        if kind == "close":
            send(sock, "ok", None)
            return 0
        try:
            result = handlers[kind](payload)
        except Exception as exc:
            send(sock, "error", failure(kind, exc))
            continue
        send(sock, "ok", result)


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fsdpkit.rollout.vllm.server")
    parser.add_argument("--channel", type=int, required=True)
    parser.add_argument("--bucket", type=int, required=True)
    parser.add_argument("--bucket-bytes", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    bind_to_parent(args.parent)  # [Note: worker lifetime]: no engine outlives its rank
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sock = socket.socket(fileno=args.channel)
    _, spec = recv(sock)
    try:
        if spec["dtype"] not in DTYPES:
            raise ValueError(f"dtype {spec['dtype']!r} is not one of {', '.join(DTYPES)}")
        server = Server(spec, SharedBucket.attach(args.bucket, args.bucket_bytes))
    except Exception as exc:
        send(sock, "error", failure("start", exc))
        return 1
    import vllm

    send(sock, "ready", {"pid": os.getpid(), "vllm": vllm.__version__})
    return serve(sock, server)


if __name__ == "__main__":
    sys.exit(main())
