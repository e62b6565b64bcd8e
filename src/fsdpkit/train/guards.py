"""Guards that stop a run instead of letting it train silently wrong.

A NaN or infinite loss (or, without a loss scaler, gradient norm) means the parameters
are, or are about to be, garbage; continuing would overwrite good checkpoints with
bad ones. The check runs on values every rank already shares: the loss is the mean
over all data-parallel ranks (an all-reduce) and the gradient norm is the global norm,
so a NaN on any one rank is a NaN on every rank and all ranks stop at the same step
without another collective. It runs before that step's checkpoint is saved, and lets
an in-flight async save of an earlier step finish.
"""

from __future__ import annotations

import math
from typing import Any

from fsdpkit.checkpoint.stepdir import step_dir_name
from fsdpkit.errors import UserError


class NonFiniteLossError(UserError):
    """Training produced a NaN or infinite loss or gradient norm."""


def _last_good(checkpointer: Any) -> str:
    if checkpointer is None or checkpointer.last_step is None:
        return "No checkpoint was saved before it (checkpoint.every = 0 or not reached yet)."

    path = checkpointer.root / step_dir_name(checkpointer.last_step)
    return (
        f"The last good checkpoint is {path} (step {checkpointer.last_step}); it is "
        "untouched, and a restart with checkpoint.resume=auto continues from it."
    )


def check_finite(
    *, loss: float, grad_norm: float, step: int, scaled: bool, checkpointer: Any = None
) -> None:
    """Raise ``NonFiniteLossError`` naming ``step`` and the last good checkpoint when
    ``loss`` (or ``grad_norm``, unless a loss scaler skips such steps) is not finite."""
    bad = []
    if not math.isfinite(loss):
        bad.append(f"loss {loss}")
    if not scaled and not math.isfinite(grad_norm):
        bad.append(f"gradient norm {grad_norm}")
    if not bad:
        return
    if checkpointer is not None:
        checkpointer.wait()  # an async save of an earlier (good) step completes first
    raise NonFiniteLossError(
        f"training stopped at step {step}: {' and '.join(bad)} (mean over all ranks). The "
        "weights after this step are not usable, so nothing more is saved. "
        f"{_last_good(checkpointer)} Common causes: a learning rate too high (train.lr), "
        "fp16 without loss scaling, bad input data, or a model whose forward overflows; "
        "lower train.lr or use precision.mode=bf16/fp32 before resuming."
    )
