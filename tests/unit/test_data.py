"""PackedLoader, split_tokens and validation_batches: per-rank batching and its position.

The token stream in most tests is ``arange(n)``, so row ``i`` of sequence id ``s`` is
``[s*seq_len, ..., s*seq_len + seq_len]`` and a batch's sequence ids read off its first
column.
"""

from __future__ import annotations

import pytest
import torch

from fsdpkit.data import DataError, PackedLoader, split_tokens, validation_batches

SEQ = 8


def stream(num_seqs: int) -> torch.Tensor:
    """A token stream that packs into exactly ``num_seqs`` sequences."""
    return torch.arange(num_seqs * SEQ + 1)


def loaders(tokens: torch.Tensor, *, world: int, batch: int = 2, seed: int = 0, **kw):
    return [
        PackedLoader(
            tokens, seq_len=SEQ, micro_batch_size=batch, dp_rank=r, dp_world=world, seed=seed, **kw
        )
        for r in range(world)
    ]


def seq_ids(batch: torch.Tensor) -> list[int]:
    return (batch[:, 0] // SEQ).tolist()


def global_step(ranks: list[PackedLoader]) -> list[int]:
    """Sequence ids of one global step, in rank order."""
    return [s for loader in ranks for s in seq_ids(loader.next_batch())]


def test_batch_shape_and_packing() -> None:
    (loader,) = loaders(stream(10), world=1, batch=3)
    batch = loader.next_batch()
    assert batch.shape == (3, SEQ + 1) and batch.dtype == torch.int64
    for row in batch:  # contiguous windows; the last token is the next window's first
        assert torch.equal(row, torch.arange(int(row[0]), int(row[0]) + SEQ + 1))
        assert int(row[0]) % SEQ == 0


def test_deterministic_given_seed() -> None:
    a, b, c = (loaders(stream(50), world=1, seed=s)[0] for s in (3, 3, 4))
    first = [a.next_batch() for _ in range(10)]
    assert all(torch.equal(x, b.next_batch()) for x in first)
    assert not all(torch.equal(x, c.next_batch()) for x in first)


def test_ranks_disjoint_within_a_step() -> None:
    ranks = loaders(stream(40), world=3, batch=2)
    for _ in range(ranks[0].steps_per_epoch):
        ids = global_step(ranks)
        assert len(ids) == len(set(ids)) == 6


def test_equal_steps_when_data_does_not_divide() -> None:
    # 7 global steps' worth plus 5 left over: every rank gets exactly 7 per epoch.
    world, batch = 3, 2
    ranks = loaders(stream(7 * world * batch + 5), world=world, batch=batch)
    assert {loader.steps_per_epoch for loader in ranks} == {7}
    seen = [s for _ in range(7) for s in global_step(ranks)]
    assert len(set(seen)) == 7 * world * batch  # an epoch never repeats a sequence
    assert {loader.state_dict()["epoch"] for loader in ranks} == {0}
    global_step(ranks)  # the 8th step rolls over on every rank at once
    assert [loader.state_dict() for loader in ranks] == [{"epoch": 1, "consumed": 6}] * world


def test_epoch_rollover_reshuffles() -> None:
    (loader,) = loaders(stream(64), world=1, batch=4)
    epochs = [[s for _ in range(16) for s in seq_ids(loader.next_batch())] for _ in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(64))
    assert epochs[0] != epochs[1]


def test_no_shuffle_is_in_order() -> None:
    (loader,) = loaders(stream(9), world=1, batch=2, shuffle=False)
    in_order = [[0, 1], [2, 3], [4, 5], [6, 7]]  # sequence 8 is the dropped remainder
    assert [seq_ids(loader.next_batch()) for _ in range(5)] == [*in_order, [0, 1]]


def test_resume_mid_epoch_gives_the_same_batches() -> None:
    tokens = stream(37)
    ranks = loaders(tokens, world=2, batch=3)
    for _ in range(4):
        global_step(ranks)
    state = ranks[0].state_dict()
    assert state == {"epoch": 0, "consumed": 24}
    expected = [global_step(ranks) for _ in range(6)]  # crosses into epoch 1
    resumed = loaders(tokens, world=2, batch=3)
    for loader in resumed:
        loader.load_state_dict(state)
    assert [global_step(resumed) for _ in range(6)] == expected


def test_position_is_world_size_independent() -> None:
    tokens = stream(100)
    small = loaders(tokens, world=2, batch=2)
    for _ in range(5):
        global_step(small)
    state = small[0].state_dict()
    big = loaders(tokens, world=4, batch=2)
    for loader in big:
        loader.load_state_dict(state)
    for _ in range(3):
        # one W=4 step = the next two W=2 steps, regrouped across the ranks in order
        assert global_step(big) == global_step(small) + global_step(small)
    assert big[0].state_dict() == small[0].state_dict()


def test_resume_near_epoch_end_at_larger_world_rolls_over() -> None:
    # 10 sequences: W=1,B=2 stops at consumed=8 with 2 left; W=2 needs 4, so epoch 1 starts.
    ranks = loaders(stream(10), world=2, batch=2)
    for loader in ranks:
        loader.load_state_dict({"epoch": 0, "consumed": 8})
    global_step(ranks)
    assert ranks[0].state_dict() == {"epoch": 1, "consumed": 4}


@pytest.mark.parametrize("state", [{}, {"epoch": "x", "consumed": 0}, {"epoch": -1, "consumed": 0}])
def test_bad_saved_position_is_a_data_error(state: dict) -> None:
    (loader,) = loaders(stream(10), world=1)
    with pytest.raises(DataError, match="data position"):
        loader.load_state_dict(state)


def test_too_small_for_one_global_step_says_how_many_tokens() -> None:
    # 4 ranks x 2 x 8 (+1) needs 65 tokens; 5 sequences are 5*8+1 = 41 tokens.
    with pytest.raises(DataError) as e:
        loaders(stream(5), world=4, batch=2)
    msg = str(e.value)
    assert "41 tokens" in msg and "at least 65 tokens" in msg and "data.seq_len" in msg


def test_bad_rank_is_rejected() -> None:
    with pytest.raises(ValueError, match="dp_rank"):
        PackedLoader(stream(10), seq_len=SEQ, micro_batch_size=1, dp_rank=2, dp_world=2, seed=0)


def test_split_takes_validation_from_the_end() -> None:
    tokens = torch.arange(1000)
    train, val = split_tokens(tokens, val_fraction=0.1)
    assert torch.equal(train, torch.arange(900)) and torch.equal(val, torch.arange(900, 1000))
    train, val = split_tokens(tokens, val_fraction=0.0)
    assert train.numel() == 1000 and val.numel() == 0


@pytest.mark.parametrize("fraction", [-0.1, 1.0])
def test_split_rejects_bad_fraction(fraction: float) -> None:
    with pytest.raises(DataError, match=r"data\.val_fraction"):
        split_tokens(torch.arange(10), val_fraction=fraction)


def test_validation_batches_equal_disjoint_in_order() -> None:
    tokens = stream(23)  # W=2, B=3: 3 full steps, 5 sequences dropped
    per_rank = [
        validation_batches(
            tokens, seq_len=SEQ, micro_batch_size=3, dp_rank=r, dp_world=2, max_batches=10
        )
        for r in range(2)
    ]
    assert [len(b) for b in per_rank] == [3, 3]
    ids = [s for i in range(3) for r in range(2) for s in seq_ids(per_rank[r][i])]
    assert ids == list(range(18))
    again = validation_batches(
        tokens, seq_len=SEQ, micro_batch_size=3, dp_rank=1, dp_world=2, max_batches=2
    )
    assert len(again) == 2 and all(torch.equal(a, b) for a, b in zip(again, per_rank[1]))


def test_validation_batches_empty_when_split_too_small() -> None:
    for r in range(4):
        assert (
            validation_batches(
                stream(3), seq_len=SEQ, micro_batch_size=1, dp_rank=r, dp_world=4, max_batches=5
            )
            == []
        )
