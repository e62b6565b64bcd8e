"""Shared pieces of the tests: a tiny Llama, deterministic batches, a plain train loop.

The same ``train`` runs the unsharded single-process reference and every sharded
variant, so parity tests compare like with like.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fsdpkit import init_weights
from fsdpkit.doctor.facts import compile_toolchain
from fsdpkit.models.accessors import is_norm
from fsdpkit.models.llama import Llama, LlamaConfig
from fsdpkit.sharding import clip_grad_norm, gradient_sync

_CXX = compile_toolchain(os.environ)
needs_cxx = pytest.mark.skipif(
    _CXX["cxx"] is None,
    reason=f"inductor's C++ compiler ({_CXX['cxx_name']}, $CXX or g++) is not on PATH, so "
    "torch.compile on CPU cannot build kernels; `fsdpkit doctor` reports it as its "
    "'compile' check. Install one (apt install g++) or point CXX at one to run this test.",
)
"""For tests that run inductor on the CPU (the same lookup ``fsdpkit train`` and the
doctor make: fsdpkit.doctor.facts.compile_toolchain)."""

TINY = LlamaConfig(
    vocab_size=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32
)
SEQ = 16
GLOBAL_BATCH = 4
PLAN_T = [
    "model.preset=tiny", "model.dim=128", "model.n_layers=2", "model.n_heads=4",
    "model.n_kv_heads=2", "model.ffn_dim=344", "model.vocab_size=1024", "data.seq_len=64",
    "train.micro_batch_size=2",
]  # fmt: skip
"""The planner tests' tiny model, as config overrides: bench/plan_accuracy.py's "T"
shape (with the tiny preset), so a test can pin a plan against that bench's measured
rows; callers add precision and layout."""


class ResidualMLP(nn.Module):
    """A non-transformer block: LayerNorm -> MLP with a residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class MLPNet(nn.Module):
    """Token embedding -> residual MLP blocks -> head: no attention, no shared names.
    ``block(dim)`` makes each block (default ``ResidualMLP``)."""

    def __init__(
        self,
        vocab: int = 128,
        dim: int = 64,
        depth: int = 4,
        block: Callable[[int], nn.Module] = ResidualMLP,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_reduce")
"""The c10d entry points FSDP2 calls (all-gather, reduce-scatter, HSDP all-reduce)."""


def count_collectives(counter: Counter[str], names: tuple[str, ...] = COLLECTIVES) -> None:
    """Wrap the c10d entry points ``names`` in this process, counting each call in
    ``counter`` under its name."""
    for name in names:
        original = getattr(dist, name)

        def counted(*args: Any, _name: str = name, _orig: Any = original, **kw: Any) -> Any:
            counter[_name] += 1
            return _orig(*args, **kw)

        setattr(dist, name, counted)


def build_mlp(*, seed: int = 0) -> MLPNet:
    model = MLPNet()
    init_weights(model, seed=seed)
    return model


def build(cfg: LlamaConfig = TINY, *, seed: int = 0, meta: bool = False) -> Llama:
    if meta:
        with torch.device("meta"):
            return Llama(cfg)
    torch.manual_seed(123)  # must not matter: init_weights overrides
    model = Llama(cfg)
    init_weights(model, seed=seed)
    return model


def global_batches(steps: int, *, vocab: int = 128, micro: int = 1, seed: int = 7) -> torch.Tensor:
    """(steps, micro, GLOBAL_BATCH, SEQ + 1) token ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (steps, micro, GLOBAL_BATCH, SEQ + 1), generator=g)


def local(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = batch.shape[0] // world
    return batch[rank * per : (rank + 1) * per]


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _clip_and_step(
    model: nn.Module, opt: torch.optim.Optimizer, *, scaler: Any, clip: float
) -> float:
    """Unscale (with a scaler), clip to ``clip`` (0 = measure only), step, zero the
    gradients; returns the global grad norm."""
    if scaler:
        scaler.unscale_(opt)
    norm = clip_grad_norm(model, clip)
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)
    return norm


def train(
    model: nn.Module,
    batches: torch.Tensor,
    *,
    rank: int = 0,
    world: int = 1,
    dp_world: int | None = None,
    lr: float = 2e-3,
    clip: float = 1.0,
    scaler: Any = None,
    keep_unsharded: bool = False,
    loss_fn: Any = None,
    opt: torch.optim.Optimizer | None = None,
) -> dict[str, list[float]]:
    """AdamW steps over ``batches``; returns per-step global mean loss and grad norm.

    ``dp_world`` is the number of data-parallel ranks sharing the global batch
    (world size for every strategy here). ``loss_fn(model, tokens)``: default ``lm_loss``.
    ``opt``: continue with this optimizer (``adamw(model)``) instead of a new one."""
    loss_fn = loss_fn or lm_loss
    dp = dp_world or world
    opt = opt or adamw(model, lr=lr)
    losses, norms = [], []
    for step in batches:
        micro = step.shape[0]
        total = torch.zeros((), device=step.device)  # on the ranks' device (NCCL: cuda)
        for i in range(micro):
            tokens = local(step[i], rank, dp)
            with gradient_sync(model, enabled=i == micro - 1, keep_unsharded=keep_unsharded):
                loss = loss_fn(model, tokens) / micro
                (scaler.scale(loss) if scaler else loss).backward()
            total += loss.detach().float()
        norms.append(_clip_and_step(model, opt, scaler=scaler, clip=clip))
        if world > 1:
            dist.all_reduce(total)
            total /= world
        losses.append(float(total))
    return {"loss": losses, "norm": norms}


def adamw(model: nn.Module, *, lr: float = 2e-3) -> torch.optim.Optimizer:
    """The AdamW of ``train``."""
    # eps=1e-6: with the default 1e-8, Adam turns gradients at rounding-noise level
    # (~1e-9) into near-full-lr updates whose sign depends on summation order, which
    # moved single elements by ~1e-5 in 10 steps; that is Adam, not sharding.
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=lr,
        weight_decay=0.1,
        eps=1e-6,
        foreach=True,
    )


def train_mixed(
    model: nn.Module,
    batches: torch.Tensor,
    *,
    dp: int,
    param_dtype: torch.dtype,
    fp32_norms: bool = False,
    scaler: Any = None,
    lr: float = 2e-3,
    clip: float = 1.0,
) -> dict[str, list[float]]:
    """What FSDP2's mixed precision computes, written out in one process: the reference
    for the low-precision parity variants (an fp32 reference differs from them by
    bf16's own rounding, ~1e-2, and so cannot tell a right reduction from a wrong one).

    Each of ``dp`` ranks runs forward and backward on its slice with a copy of the fp32
    master weights cast to ``param_dtype`` (norm weights kept fp32 with ``fp32_norms``:
    ``Precision.norm_policy``, whose bf16 output the fp32 RMSNorm gives itself; buffers
    stay fp32, as FSDP2 leaves them); the low-precision gradients are cast to fp32 and
    averaged in fp32 (``reduce_dtype``), then clipped and stepped by the same AdamW (and
    scaler) as ``train``. ``model`` is the master and is trained in place."""
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=lr, weight_decay=0.1, eps=1e-6, foreach=True,
    )  # fmt: skip
    norm_params = {id(p) for m in model.modules() if is_norm(m) for p in m.parameters()}
    losses, norms = [], []
    for step in batches:
        assert step.shape[0] == 1, "train_mixed: no gradient accumulation"
        compute = copy.deepcopy(model)  # ties survive the copy and the in-place cast
        for master, p in zip(model.parameters(), compute.parameters()):
            if not (fp32_norms and id(master) in norm_params):
                p.data = p.data.to(param_dtype)
        summed = [torch.zeros_like(p) for p in model.parameters()]
        total = 0.0
        for rank in range(dp):
            compute.zero_grad(set_to_none=True)
            loss = lm_loss(compute, local(step[0], rank, dp))
            (scaler.scale(loss) if scaler else loss).backward()
            total += float(loss.detach())
            for acc, p in zip(summed, compute.parameters()):
                acc += p.grad.float()
        for p, acc in zip(model.parameters(), summed):
            p.grad = acc / dp
        norms.append(_clip_and_step(model, opt, scaler=scaler, clip=clip))
        losses.append(total / dp)
    return {"loss": losses, "norm": norms}


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded parameters (collective on sharded models)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().float().cpu().clone()
    return out


def untied(cfg: LlamaConfig = TINY) -> LlamaConfig:
    return replace(cfg, tie_embeddings=False)


class LoadProbe:
    """A checkpoint Stateful that counts how often a load was applied to it (a failed
    resume must apply nothing)."""

    def __init__(self) -> None:
        self.loaded = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": torch.tensor(1)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.loaded += 1


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``code`` (dedented) run by a fresh Python, output captured: for signal handlers and
    process-lifetime guards, which end or kill the process they run in."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


PROBE = torch.arange(2 * 12).reshape(2, 12) * 7 % 256
"""Token ids whose logits compare a model with its export or its reference."""


def eval_logits(model: nn.Module, probe: torch.Tensor = PROBE) -> torch.Tensor:
    """The model's logits on ``probe`` in eval mode (collective on sharded models)."""
    from torch.distributed.fsdp import FSDPModule

    from fsdpkit.loss.contract import logits_of

    model.eval()
    with torch.no_grad():
        out = logits_of(model(probe), tokens=probe).detach().clone()
    model.train()
    for unit in model.modules():
        # A no-grad forward leaves the root and the last block unsharded (they do not
        # reshard after forward), and an optimizer built then would hold those tensors.
        if isinstance(unit, FSDPModule):
            unit.reshard()
    return out


def preference_pairs(tmp: Path) -> Path:
    """``tmp/pairs.jsonl``: 96 preference rows (prompt / chosen / rejected strings) a
    DPO run learns from (written once)."""
    out = tmp / "pairs.jsonl"
    if not out.exists():
        words = ["red", "blue", "green", "cyan", "gold", "pink", "gray", "teal"]
        rows = [
            {"prompt": f"q{i}: ", "chosen": f"{words[i % 8]} " * 2, "rejected": words[i % 5]}
            for i in range(96)
        ]
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out
