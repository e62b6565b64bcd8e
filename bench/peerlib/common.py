"""What every implementation shares, so the rows differ only in the framework:

- the spec (model preset, sequence length, per-rank batch, steps, AdamW, clipping),
  passed as JSON in $PEERS_SPEC;
- the data: fsdpkit's packed loader over the built-in corpus, so every implementation
  sees the same per-rank batches in the same order;
- the model: fsdpkit's Llama preset with fsdpkit's deterministic init (the same weights
  that ``fsdpkit.shard`` materializes from the meta device);
- the loss (next-token cross-entropy on fp32 logits), the AdamW parameter groups
  (no decay on 1-D parameters, as fsdpkit), the AdamW kernel (``Spec.adamw``: the
  same one passed explicitly to every framework at the shared settings, or
  ``"default"``: whatever the framework does when the user names none) and the
  measurement loop: wall time per
  step, the global mean loss of every step, and the peak of live tensor memory during
  one fixed step (c10's process-wide CPU allocator count, as fsdpkit.planner.traced.measure;
  everything the process holds in tensors, the data included, as ``fsdpkit train``'s
  profiler reports it; ``baseline_bytes`` is what was live before the model existed).

An implementation script builds its model/optimizer its framework's way and calls
``run(step_fn)`` where ``step_fn(tokens)`` does forward, backward, clipping, optimizer
step and zero_grad, and returns the local loss.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fsdpkit.cpumem import enable_process_wide_accounting, live_bytes, peak_bytes

SPEC_VAR = "PEERS_SPEC"


@dataclass(frozen=True)
class Spec:
    preset: str = "tiny"
    seq_len: int = 128
    micro_batch: int = 4
    steps: int = 8
    warmup: int = 2
    lr: float = 3e-3
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    max_bytes: int = 300_000
    adamw: str = "fused"
    """torch AdamW kernel: fused, foreach or for-loop, passed explicitly; "default":
    the framework's own choice (torch.optim.AdamW's: for-loop on CPU; DeepSpeed's
    config optimizer without ``torch_adam``)."""
    out: str = ""

    @property
    def memory_step(self) -> int:
        """The last step: profiled for memory, so left out of the timing."""
        return self.steps

    @classmethod
    def from_env(cls) -> Spec:
        return cls(**json.loads(os.environ[SPEC_VAR]))


def begin() -> Spec:
    """Call first thing (before any tensor): turns on process-wide allocator counting."""
    enable_process_wide_accounting()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return Spec.from_env()


def loader(spec: Spec, *, rank: int, world: int) -> Any:
    from fsdpkit.config import DataConfig
    from fsdpkit.data import PackedLoader, build_tokenizer, load_token_stream, split_tokens

    data = DataConfig(seq_len=spec.seq_len, max_bytes=spec.max_bytes)
    tokens, _ = split_tokens(load_token_stream(data, build_tokenizer(data)), val_fraction=0.02)
    return PackedLoader(
        tokens,
        seq_len=spec.seq_len,
        micro_batch_size=spec.micro_batch,
        dp_rank=rank,
        dp_world=world,
        seed=spec.seed,
    )


def build_model(spec: Spec, *, device: str = "cpu") -> nn.Module:
    """The full model with fsdpkit's deterministic weights (what a user would load)."""
    from fsdpkit import init_weights
    from fsdpkit.models.llama import Llama, preset

    with torch.device(device):
        model = Llama(preset(spec.preset, max_seq_len=max(spec.seq_len, 256)))
    init_weights(model, seed=spec.seed)
    return model


def block_class() -> type[nn.Module]:
    from fsdpkit.models.llama import DecoderLayer

    return DecoderLayer


def param_groups(model: nn.Module, spec: Spec) -> list[dict[str, Any]]:
    """AdamW groups as fsdpkit builds them: weight decay on matrices only."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": spec.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def adamw_kwargs(spec: Spec) -> dict[str, bool]:
    """torch.optim.AdamW's switches for ``spec.adamw`` (none for "default")."""
    switches = {"fused": {"fused": True}, "foreach": {"foreach": True}}
    switches["for-loop"] = {"foreach": False}
    if spec.adamw != "default" and spec.adamw not in switches:
        raise ValueError(f"Spec.adamw = {spec.adamw!r}: use fused, foreach, for-loop or default")
    return switches.get(spec.adamw, {})


def adamw(model: nn.Module, spec: Spec) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        param_groups(model, spec), lr=spec.lr, betas=(spec.beta1, spec.beta2), **adamw_kwargs(spec)
    )


def kernel_of(opt: torch.optim.Optimizer) -> str:
    """The AdamW kernel ``opt`` steps with, as built (recorded per row); a framework's
    wrapper (Accelerate's, DeepSpeed's) is looked through."""
    while not isinstance(opt, torch.optim.AdamW) and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    if not isinstance(opt, torch.optim.AdamW):
        return type(opt).__module__.split(".")[0] + "." + type(opt).__name__
    if opt.defaults.get("fused"):
        return "torch fused"
    if opt.defaults.get("foreach"):
        return "torch foreach"
    if opt.defaults.get("foreach") is None:
        return "torch for-loop (torch's CPU default)"
    return "torch for-loop"


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    if not isinstance(logits, torch.Tensor):  # HF-style outputs
        logits = logits.logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def local_shard_fraction(model: nn.Module) -> float:
    """Parameter elements this rank holds / the model's: 1/N when sharded, 1 when not."""
    from torch.distributed.tensor import DTensor

    local = total = 0
    for p in model.parameters():
        if isinstance(p, DTensor):
            local += p.to_local().numel()
            total += p.numel()
        else:
            ds_numel = getattr(p, "ds_numel", None)  # DeepSpeed ZeRO-3 partitioned params
            local += p.ds_tensor.numel() if ds_numel is not None else p.numel()
            total += ds_numel if ds_numel is not None else p.numel()
    return local / max(total, 1)


def run(
    spec: Spec,
    step_fn: Callable[[torch.Tensor], torch.Tensor],
    *,
    batches: Any,
    baseline: int,
    extra: dict[str, Any] | None = None,
) -> None:
    """Run the steps, measure, and (rank 0) write the result JSON to ``spec.out``."""
    losses, times, peak = [], [], 0
    for i in range(1, spec.steps + 1):
        tokens = batches.next_batch()
        holder: list[torch.Tensor] = []
        t0 = time.perf_counter()
        if i == spec.memory_step:
            peak = peak_bytes(lambda t=tokens, h=holder: h.append(step_fn(t)))
        else:
            holder.append(step_fn(tokens))
        loss = holder[0].detach().float().clone()
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)
        losses.append(float(loss) / dist.get_world_size())
        times.append(time.perf_counter() - t0)
    peaks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    if dist.get_rank() == 0:
        result = {
            "losses": losses,
            "step_times": times,
            "timed_steps": list(range(spec.warmup + 1, spec.memory_step)),
            "tokens_per_step": spec.micro_batch * spec.seq_len * dist.get_world_size(),
            "peak_bytes_per_rank": peaks,
            "baseline_bytes": baseline,
            **(extra or {}),
        }
        Path(spec.out).write_text(json.dumps(result))


def finish() -> None:
    """Leave without interpreter teardown (gloo can abort there; cpu-fsdp-facts.md)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def baseline_bytes() -> int:
    """Live tensor bytes before the model exists (the data is held by then)."""
    return live_bytes()
