"""``PackedLoader`` resumed at other world sizes with ``train.global_batch_size`` set: every
optimizer step takes the same sequences as the uninterrupted run (the run itself:
tests/e2e/test_elastic_resume.py)."""

from __future__ import annotations

import torch

from fsdpkit.config import TrainConfig, batch_split
from fsdpkit.data import PackedLoader

SEQ = 4


def _step_ids(ranks: list[PackedLoader]) -> list[int]:
    """The sorted sequence ids of one optimizer step over all ranks."""
    return sorted(int(s) for r in ranks for b in r.next_step() for s in b[:, 0] // SEQ)


def _ranks(tokens: torch.Tensor, world: int, global_batch: int, cap: int) -> list[PackedLoader]:
    split = batch_split(
        TrainConfig(global_batch_size=global_batch, micro_batch_size=cap), dp_world=world
    )
    return [
        PackedLoader(tokens, seq_len=SEQ, micro_batch_size=split.micro_batch, dp_rank=r,
                     dp_world=world, seed=3, grad_accum=split.grad_accum)
        for r in range(world)
    ]  # fmt: skip


def test_resuming_at_other_world_sizes_takes_the_same_sequences_per_step() -> None:
    tokens = torch.arange(53 * SEQ + 1)  # 53 sequences: 4 steps of 12 per epoch, 5 dropped
    reference = _ranks(tokens, 2, 12, 4)
    expected = [_step_ids(reference) for _ in range(10)]  # crosses two epoch ends
    got, ranks = [], _ranks(tokens, 2, 12, 4)
    for world, steps in ((2, 3), (3, 3), (4, 4)):
        state = ranks[0].state_dict()
        ranks = _ranks(tokens, world, 12, 4)
        for loader in ranks:
            loader.load_state_dict(state)
        got += [_step_ids(ranks) for _ in range(steps)]
    assert got == expected
    first_epoch = [s for step in expected[:4] for s in step]
    assert len(first_epoch) == len(set(first_epoch)) == 48  # none skipped or repeated
