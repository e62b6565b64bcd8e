"""Where metrics go besides metrics.jsonl: TensorBoard event files and Weights & Biases
(rank 0 only, the same scalars). Each is an optional dependency, checked when the run
starts so a missing package fails before any training, naming the field."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Protocol, TypeGuard

from fsdpkit.errors import UserError

# metrics.jsonl key -> scalar tag. peak_mem_mib (a list, one per rank) is spread out; a
# GRPO run's rl/* keys (fsdpkit.train.rl_step) keep their names as tags.
TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "step_time_s": "perf/step_time_s",
    "mfu": "perf/mfu",
    "val_loss": "val/loss",
    "checkpoint_blocking_s": "checkpoint/blocking_s",
    "rewards/chosen": "dpo/rewards_chosen",
    "rewards/rejected": "dpo/rewards_rejected",
    "rewards/accuracy": "dpo/rewards_accuracy",
    "rewards/margin": "dpo/rewards_margin",
}


class MissingPackage(UserError):
    """A logging option needs a package that is not installed."""


def require(module: str, *, field: str, pip: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise MissingPackage(
            f"{field} needs the {module!r} package, which is not installed. Install it "
            f"with `pip install {pip}`, or turn {field} off."
        )


def _tag(key: str) -> str | None:
    """A record key's tag: the table's, GRPO's rl/* as they are, held-out val_* under
    val/ (None: not a scalar the sinks show)."""
    if key in TAGS:
        return TAGS[key]
    if key.startswith("rl/"):
        return key
    if key.startswith("val_"):
        return "val/" + key.removeprefix("val_")
    return None


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric values of one metrics record under their tags."""
    out = {}
    for key, value in record.items():
        tag = _tag(key)
        if tag and _number(value):
            out[tag] = float(value)
    for rank, mib in enumerate(record.get("peak_mem_mib") or []):
        out[f"memory/peak_mib_rank{rank}"] = float(mib)
    return out


def _number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


class Sink(Protocol):
    def write(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Event files under ``RUN_DIR/tensorboard`` (``tensorboard --logdir RUN_DIR``)."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def write(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run in ``RUN_DIR/wandb``; offline mode needs no network (``wandb sync``
    uploads it later)."""

    def __init__(self, run_dir: Path, *, mode: str, config: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(
            project="fsdpkit",
            name=run_dir.resolve().name,
            dir=str(run_dir),
            mode=mode,  # type: ignore[arg-type]
            config=config,
            settings=wandb.Settings(silent=True),
        )

    def write(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def check_installed(*, tensorboard: bool, wandb: str) -> None:
    """Fail early (every rank alike) when an enabled sink's package is missing."""
    if tensorboard:
        require("tensorboard", field="logging.tensorboard", pip="'fsdpkit[tensorboard]'")
    if wandb != "off":
        require("wandb", field="logging.wandb", pip="'fsdpkit[wandb]'")
