"""The rows of bench/peers.py: which implementation runs, at which settings.

Two groups. **Shared settings** (the overhead comparison): every row steps the same
torch AdamW kernel (``SHARED_ADAMW``, passed explicitly to each framework), decays
matrices only, and computes the loss from full fp32 logits with ``F.cross_entropy``;
the FSDP2 rows shard every block, then the root. **Defaults** (the value of defaults):
what a user gets without choosing: fsdpkit train's own defaults (``train.optimizer_impl
= auto``, ``train.chunked_loss = auto``); torch
AdamW's own kernel choice, which is what the hand-written loop, Accelerate, Fabric and
DDP all step (each passes the user's ``torch.optim.AdamW`` through unchanged, and
their docs build it with no kernel switch), so one row stands for the four; and
DeepSpeed's own AdamW (its config optimizer without ``torch_adam``). Hyper-parameters
(LR, betas, weight decay and its rule, clipping, steps) stay the shared ones in both
groups, so every row's losses stay comparable with DDP's.
"""

from __future__ import annotations

from dataclasses import dataclass

SHARED_ADAMW = "fused"
"""The kernel every row steps at the shared settings: fused is fsdpkit's default on
CPU (train.optimizer_impl = auto) and every framework here can be handed it."""
FULL_LOSS = "full fp32 logits + F.cross_entropy"
BLOCK_UNITS = "every block, then the root"
SHARED_CLI = ("train.optimizer_impl=fused", "train.chunked_loss=off")
"""fsdpkit train at the shared settings: the overrides that differ from its defaults.
(``parallel.edge_units``, on by default, gives an *untied* embedding and head units of
their own; the tiny preset ties them, so its units are the hand-written loop's either
way.)"""


@dataclass(frozen=True)
class Row:
    label: str
    module: str | None
    """The ``peerlib.impl_*`` script; None: the ``fsdpkit train`` CLI."""
    package: str | None = None
    """The peer package the row needs installed (the ``bench`` extra)."""
    defaults: bool = False
    """Measured at the framework's own defaults, not at the shared settings."""
    adamw: str = SHARED_ADAMW
    """``Spec.adamw`` of the script (the CLI's is in ``cli``)."""
    cli: tuple[str, ...] = SHARED_CLI
    """fsdpkit train only: overrides beyond the workload's."""
    loss: str = FULL_LOSS
    units: str = BLOCK_UNITS
    shared_twin: str | None = None
    """Defaults rows: the row of the same framework at the shared settings."""


_ZERO3 = "ZeRO-3: each parameter partitioned, gathered in buckets"
ROWS: dict[str, Row] = {
    "hand-A": Row("hand-written FSDP2 (A)", "impl_hand"),
    "fsdpkit-api": Row("fsdpkit library (fsdpkit.shard)", "impl_fsdpkit_api"),
    "fsdpkit-train": Row("fsdpkit train (CLI)", None),
    "accelerate": Row("Accelerate FSDP2 plugin*", "impl_accelerate", "accelerate"),
    "fabric": Row("Lightning Fabric FSDP2", "impl_fabric", "lightning"),
    "deepspeed": Row("DeepSpeed ZeRO-3", "impl_deepspeed", "deepspeed", units=_ZERO3),
    "ddp": Row("DDP (unsharded reference)", "impl_ddp", units="none: every rank holds all"),
    "hand-B": Row("hand-written FSDP2 (B: A again, the control)", "impl_hand"),
    "fsdpkit-defaults": Row(
        "fsdpkit train, its defaults",
        None,
        defaults=True,
        cli=(),
        loss="fsdpkit chunked CE, 1,024-token chunks (auto: on)",
        shared_twin="fsdpkit-train",
    ),
    "torch-defaults": Row(
        "hand-written FSDP2, torch AdamW's own kernel (= Accelerate, Fabric, DDP)",
        "impl_hand",
        defaults=True,
        adamw="default",
        shared_twin="hand-A",
    ),
    "deepspeed-defaults": Row(
        "DeepSpeed ZeRO-3, its own AdamW",
        "impl_deepspeed",
        "deepspeed",
        defaults=True,
        adamw="default",
        units=_ZERO3,
        shared_twin="deepspeed",
    ),
}
BASELINE, CONTROL, REFERENCE = "hand-A", "hand-B", "ddp"


def cli_adamw(row: Row) -> str:
    """The kernel ``fsdpkit train`` steps for a CLI row, as fsdpkit resolves it on CPU."""
    from fsdpkit.trainable.optim import resolve_impl

    chosen = next(
        (o.split("=", 1)[1] for o in row.cli if o.startswith("train.optimizer_impl=")), "auto"
    )
    return f"torch {resolve_impl(chosen, device_type='cpu')} (train.optimizer_impl={chosen})"
