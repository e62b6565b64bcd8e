"""Which blocks recompute their activations in backward, and how (``[activations]``).

``shard()`` checkpoints them before sharding (fsdpkit.sharding.apply); the planner
asks the same functions which blocks are recomputed and what selective mode keeps.

[Note: selective checkpointing]
``activations.mode = "selective"`` is op-level selective activation checkpointing
as torchtitan's default ("op") policy does it: every block runs under
``torch.utils.checkpoint`` with a policy that saves the outputs of compute-heavy ops
(every other matmul, attention, collectives) and recomputes everything else
(norms, RoPE, activations, casts, adds) in backward. The saved set of the built-in
Llama block follows from the op order (fsdpkit.planner.replay.blockmem models it).

Forward and recompute must agree op for op: the recompute hands a saved output
back where forward saved one. Where the policy is consulted in both passes (the
``ctx.is_recompute`` design torchtitan's policy is written for) a saved output is
popped from a per-op list when the policy says "save" in recompute, so a single
matmul counter shared by both passes breaks on an odd number of matmuls (7 in a
Llama block: q, k, v, o, gate, up, down): the recompute starts on an odd count,
flips the parity, recomputes the matmuls forward saved and pops saved outputs for
the ones it did not — another matmul's output, silently when shapes agree. Hence
one counter per pass. On torch 2.13 (fsdpkit's minimum) the recompute no longer
asks the policy: forward records each decision by (op, call index) and the
recompute replays them (``is_recompute`` is always False), so the passes agree by
construction and the per-pass counter is what keeps the policy right either way.
What matters on every version is that the counters start fresh for each
checkpointed call: ``selective_context`` builds a new policy per call, so every
block (and every micro-batch) saves the same matmuls (1st, 3rd, 5th, 7th) — which
is also what the planner assumes. tests/unit/test_selective_checkpointing.py checks both, on a
three-matmul block.

[Note: where the checkpoint sits]
The composable ``checkpoint`` (module hooks) recomputes by calling the module again,
so FSDP2's hooks on the same module run inside the recompute but not inside the
checkpointed forward (its pre-forward hook is prepended, so it runs before the
checkpoint starts): their ``record_function`` ops then appear only in the
recompute, and selective checkpointing, which replays the forward's op sequence,
fails ("profiler._record_function_enter_new ... not found in storage"). Full
checkpointing does not mind. So selective mode (and compiled blocks, [Note:
checkpointing compiled blocks] in fsdpkit.sharding.compile) wraps the block's own
``forward`` in ``torch.utils.checkpoint``: the recompute calls that forward, never
the hooks — the structure of torchtitan's checkpoint wrapper, without its renamed
``_checkpoint_wrapped_module`` parameters.
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fsdpkit.config import ActivationsConfig


def is_checkpointed(index: int, cfg: ActivationsConfig) -> bool:
    """Whether block ``index`` (0-based, forward order) runs under activation
    checkpointing: none, every block (full, selective), or every k-th (the k-th,
    2k-th, ... blocks). The planner asks the same question of the same function."""
    if cfg.mode in ("full", "selective"):
        return True
    return cfg.mode == "every" and index % cfg.every == cfg.every - 1


def checkpointed_blocks(blocks: list[nn.Module], cfg: ActivationsConfig) -> list[nn.Module]:
    """The blocks the policy recomputes (wholly or in part) in backward."""
    return [b for i, b in enumerate(blocks) if is_checkpointed(i, cfg)]


MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm")
"""aten matmuls (default overloads) counted for "every other matmul"; ``nn.Linear``
reaches ``mm`` (no bias) or ``addmm`` (bias), batched attention matmuls ``bmm``."""

ATTENTION_PREFIX = "_scaled_dot_product_"
"""Every fused SDPA kernel (flash, efficient, cudnn, the CPU flash kernel...); their
backward overloads never run inside the forward or its recompute."""

COLLECTIVE_OPS = (
    "all_reduce",
    "reduce_scatter_tensor",
    "all_gather_into_tensor",
    "all_to_all_single",
)
"""Functional collectives (tensor-parallel blocks): recomputing one would repeat it."""


@functools.cache
def _op_sets() -> tuple[frozenset[Any], frozenset[Any]]:
    """(matmul overloads, other always-saved overloads), looked up once."""
    import torch.distributed._functional_collectives

    aten = torch.ops.aten
    matmuls = frozenset(getattr(aten, name).default for name in MATMUL_OPS)
    attention = [
        getattr(aten, name).default
        for name in dir(aten)
        if name.startswith(ATTENTION_PREFIX) and not name.endswith("_backward")
    ]
    functional = torch.ops._c10d_functional
    collectives = [getattr(functional, n).default for n in COLLECTIVE_OPS if hasattr(functional, n)]
    return matmuls, frozenset(attention + collectives)


def matmul_saved(count: int) -> bool:
    """Whether the ``count``-th matmul of a checkpointed call (1 for the first) is
    saved: the odd ones (1st, 3rd, ...) are, the even ones recomputed. The planner
    asks this too (step time, fsdpkit.planner.search.recommend)."""
    return count % 2 == 1


def op_decision(func: Any, *, matmul_count: int) -> bool:
    """Whether selective checkpointing saves ``func``'s output; ``matmul_count`` is how
    many matmuls this pass has met including this one."""
    matmuls, always = _op_sets()
    if func in matmuls:
        return matmul_saved(matmul_count)
    return func in always


class SelectivePolicy:
    """The policy of one checkpointed call ([Note: selective checkpointing]): a
    matmul counter per pass, so forward and recompute agree op for op."""

    def __init__(self) -> None:
        self.matmuls = {"forward": 0, "recompute": 0}

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        count = 0
        if func in _op_sets()[0]:
            key = "recompute" if ctx.is_recompute else "forward"
            self.matmuls[key] += 1
            count = self.matmuls[key]
        save = op_decision(func, matmul_count=count)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
    """``context_fn`` for ``checkpoint``: (forward, recompute) contexts sharing one
    fresh ``SelectivePolicy`` — called once per checkpointed forward of a block."""
    return create_selective_checkpoint_contexts(SelectivePolicy())


def checkpoint_kwargs(cfg: ActivationsConfig) -> dict[str, Any]:
    """Extra arguments of the checkpoint call for this mode (the selective policy)."""
    return {"context_fn": selective_context} if cfg.mode == "selective" else {}


def checkpoint_forward(block: nn.Module, *, cfg: ActivationsConfig) -> None:
    """Run ``block``'s forward under ``torch.utils.checkpoint`` by replacing the
    instance's ``forward`` (names and state-dict keys unchanged; [Note: where the
    checkpoint sits])."""
    inner = block.forward
    extra = checkpoint_kwargs(cfg)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(
            inner, *args, use_reentrant=False, **extra, **kwargs
        )

    forward.checkpoint_mode = cfg.mode  # type: ignore[attr-defined]
    block.forward = forward  # type: ignore[method-assign]


def checkpoint_mode(block: nn.Module) -> str | None:
    """The ``activations.mode`` that ``checkpoint_forward`` applied to ``block``, or
    None: how a test (tests/distributed/test_plan_matches_shard.py) reads back which
    blocks run under the selective policy, which leaves no module state of its own."""
    return getattr(block.forward, "checkpoint_mode", None)
