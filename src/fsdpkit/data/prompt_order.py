"""Which prompts each RL step samples, and the rank's entry point ``open_prompt_data``.

    data = open_prompt_data(cfg.data, max_prompt_length=cfg.rl.max_prompt_length,
                            prompts_per_step=P, seed=cfg.train.seed, dp_rank=r, dp_world=W,
                            required=rewards.required_columns)
    print(data.note)                      # what the run samples from
    batch = data.loader.next_step()       # PromptBatch: this rank's P / W prompts

[Note: prompt order]
Step ``s`` takes ``P`` prompts (``prompts_per_step``) from an epoch's seeded permutation
of the training prompts (fsdpkit.data.order: the same on every rank, computed per
position): positions ``[c, c + P)`` with ``c`` the prompts of the epoch already taken.
When fewer than ``P`` remain, the epoch ends and the next one (a fresh permutation)
starts at 0: a step never mixes epochs, every epoch drops the same remainder. The step's
``P`` indices are identical on every rank and independent of the world size; data-parallel
rank ``r`` of ``W`` samples the contiguous share ``[r P / W, (r + 1) P / W)`` (``P`` must be
a multiple of ``W``, so every rank generates and steps alike). The position is
``{"epoch", "consumed"}`` as every other loader's ([Note: Data position maps sensibly]):
a resumed run, at any world size, continues with the very prompts the uninterrupted run
would have taken.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fsdpkit.config import DataConfig
from fsdpkit.data.errors import DataError
from fsdpkit.data.loader import parse_position
from fsdpkit.data.order import Permutation
from fsdpkit.data.pipeline import TrainingData
from fsdpkit.data.prompts import PromptRow, load_prompts
from fsdpkit.data.tokenizer import build_tokenizer


@dataclass(frozen=True)
class PromptBatch:
    """This rank's prompts of one step ([Note: prompt order])."""

    step_rows: np.ndarray
    """Table indices of the whole step's prompts, on every rank alike (``P``)."""
    start: int
    """Where this rank's share starts in ``step_rows`` (its prompts' step positions are
    ``start, start + 1, ...``: a world-size-independent name for a prompt of a step)."""
    rows: list[PromptRow]
    """This rank's prompts, in step order."""

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def positions(self) -> np.ndarray:
        """Each prompt's position in the step (``0 <= position < P``)."""
        return np.arange(self.start, self.start + len(self.rows), dtype=np.int64)

    @property
    def ids(self) -> list[np.ndarray]:
        """Each prompt's token ids (int64)."""
        return [r.ids for r in self.rows]

    @property
    def row_ids(self) -> np.ndarray:
        """Each prompt's row index in data.path (``PromptRow.row``)."""
        return np.asarray([r.row for r in self.rows], dtype=np.int64)

    def repeat(self, times: int) -> list[PromptRow]:
        """Each row ``times`` times in a row: the layout of G completions per prompt."""
        return [r for r in self.rows for _ in range(times)]


class PromptLoader:
    """Infinite per-rank iterator of ``PromptBatch`` ([Note: prompt order])."""

    def __init__(
        self,
        rows: Sequence[PromptRow],
        *,
        prompts_per_step: int,
        seed: int,
        dp_rank: int,
        dp_world: int,
    ) -> None:
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_world={dp_world})")
        if prompts_per_step < 1 or prompts_per_step % dp_world:
            raise DataError(
                f"{prompts_per_step} prompts per step cannot be split evenly over "
                f"{dp_world} data-parallel ranks: each rank samples an equal share. Use a "
                f"multiple of {dp_world} prompts per step."
            )
        if len(rows) < prompts_per_step:
            raise DataError(
                f"The prompt data has {len(rows)} training prompts (after data.val_fraction "
                f"and rl.max_prompt_length), but one step samples {prompts_per_step}. Use "
                "more prompt rows, or fewer prompts per step."
            )
        self._rows, self._per_step, self._seed = list(rows), prompts_per_step, seed
        self._share = prompts_per_step // dp_world
        self._first = dp_rank * self._share
        self._epoch = self._consumed = 0
        self._order = Permutation(len(self._rows), seed=seed, epoch=0)
        self._order_epoch = 0

    @property
    def steps_per_epoch(self) -> int:
        return len(self._rows) // self._per_step

    @property
    def num_sequences(self) -> int:
        """Training prompts in one epoch before the remainder is dropped."""
        return len(self._rows)

    @property
    def step_sequences(self) -> int:
        """Prompts of one step over all ranks (``P``)."""
        return self._per_step

    def next_step(self) -> PromptBatch:
        """This rank's prompts of the next step; the position moves by one step (into
        the next epoch first when this one has fewer than a step's prompts left)."""
        if len(self._rows) - self._consumed < self._per_step:
            self._epoch, self._consumed = self._epoch + 1, 0
        if self._order_epoch != self._epoch:
            self._order = Permutation(len(self._rows), seed=self._seed, epoch=self._epoch)
            self._order_epoch = self._epoch
        step = self._order(np.arange(self._consumed, self._consumed + self._per_step))
        self._consumed += self._per_step
        mine = step[self._first : self._first + self._share]
        return PromptBatch(step, self._first, [self._rows[int(i)] for i in mine])

    def state_dict(self) -> dict[str, int]:
        """The position as (epoch, global prompts consumed): independent of world size."""
        return {"epoch": self._epoch, "consumed": self._consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._epoch, self._consumed = parse_position(state)


def held_out(rows: Sequence[PromptRow], *, dp_rank: int, dp_world: int) -> list[PromptBatch]:
    """This rank's contiguous share of the held-out prompts, as one batch (every rank
    the same count: the remainder of ``len(rows) / dp_world`` is left out), or none."""
    share = len(rows) // dp_world
    if not share:
        return []
    order = np.arange(share * dp_world, dtype=np.int64)
    mine = list(rows[dp_rank * share : (dp_rank + 1) * share])
    return [PromptBatch(order, dp_rank * share, mine)]


def open_prompt_data(
    cfg: DataConfig,
    *,
    max_prompt_length: int,
    prompts_per_step: int,
    seed: int,
    dp_rank: int,
    dp_world: int,
    required: Mapping[str, Sequence[str]] | None = None,
) -> TrainingData:
    """``open_training_data`` for ``train.objective = grpo``: the tokenizer, this rank's
    ``PromptLoader`` (``next_step() -> PromptBatch``, world-size independent position),
    its share of the held-out prompts (``val``: one ``PromptBatch`` or none) and the note
    the run prints first; ``required``: reward name -> the columns it reads (any one)."""
    tokenizer = build_tokenizer(cfg)
    table = load_prompts(cfg, tokenizer, max_prompt_length=max_prompt_length, required=required)
    loader = PromptLoader(
        table.train,
        prompts_per_step=prompts_per_step,
        seed=seed,
        dp_rank=dp_rank,
        dp_world=dp_world,
    )
    val = held_out(table.val, dp_rank=dp_rank, dp_world=dp_world)
    note = (
        f"{table.describe(max_prompt_length=max_prompt_length)}; {prompts_per_step} prompts "
        f"per step ({prompts_per_step // dp_world} per data-parallel rank), "
        f"{loader.steps_per_epoch:,} steps per epoch"
    )
    record: dict[str, Any] = {
        "prompts": len(table.train),
        "held_out_prompts": len(table.val),
        "prompts_too_long": table.too_long,
        "train_sequences": len(table.train),
        "steps_per_epoch": loader.steps_per_epoch,
    }
    return TrainingData(tokenizer, loader, val, False, note, record=record)
