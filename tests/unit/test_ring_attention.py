"""``parallel.cp_attention = "ring"``: each cp rank's tokens in torch's head-tail order,
packed rows and sequences that do not split into 2 x cp chunks refused by field, and
the heads rule that applies only to Ulysses. (Parity of ring attention with the
unsharded model: tests/distributed/test_model_parallel.py, the "-ring" variants.)"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.experimental._context_parallel import _HeadTailLoadBalancer

from fsdpkit.config import load
from fsdpkit.data.batch import SFTBatch
from fsdpkit.errors import ConfigError
from fsdpkit.sharding.context.batch import slice_batch
from fsdpkit.sharding.context.ring import head_tail_index
from fsdpkit.sharding.heads import heads_cp
from fsdpkit.sharding.tensor.rules import check_layout

CPU = torch.device("cpu")


@pytest.mark.parametrize(("seq", "cp"), [(16, 2), (32, 4), (24, 3)])
def test_head_tail_chunks_are_torchs_load_balanced_order(seq: int, cp: int) -> None:
    # torch's ring attention assumes exactly this order when load balancing is on
    order = _HeadTailLoadBalancer(seq, cp, CPU)._generate_indices()[0].view(cp, -1)
    for rank in range(cp):
        assert (
            head_tail_index(seq=seq, cp=cp, rank=rank, device=CPU).tolist() == order[rank].tolist()
        )


def test_the_ranks_hold_every_token_once() -> None:
    held = torch.cat([head_tail_index(seq=32, cp=4, rank=r, device=CPU) for r in range(4)])
    assert sorted(held.tolist()) == list(range(32))


def test_ring_slice_keeps_tokens_targets_and_positions_together() -> None:
    tokens = torch.arange(17).expand(2, 17)
    part = slice_batch(tokens, rank=1, cp=2, ring=True)
    want = [4, 5, 6, 7, 8, 9, 10, 11]  # chunks 1 and 2 of 4
    assert part.inputs[0].tolist() == want
    assert part.targets[0].tolist() == [t + 1 for t in want]
    assert part.positions is not None and part.positions[0].tolist() == want
    assert part.normalizer == 2 * 16 / 2  # [Note: context-parallel loss normalization]


def test_packed_rows_are_refused_with_ring_attention() -> None:
    inputs = torch.zeros(1, 16, dtype=torch.long)
    positions = torch.cat([torch.arange(7), torch.arange(9)]).unsqueeze(0)
    batch = SFTBatch(inputs=inputs, targets=inputs, positions=positions)
    with pytest.raises(ConfigError, match=r"data\.pack = false"):
        slice_batch(batch, rank=0, cp=2, ring=True)
    assert slice_batch(batch, rank=0, cp=2).inputs.shape == (1, 8)  # Ulysses takes them


def test_a_sequence_that_is_not_2_x_cp_chunks_is_refused() -> None:
    with pytest.raises(ConfigError, match="multiple of 4"):
        head_tail_index(seq=18, cp=2, rank=0, device=CPU)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ([], "parallel.cp = 1"),
        (["parallel.cp=2", "data.seq_len=18"], "data.seq_len = 18"),
        (["parallel.cp=2", "data.format=sft", "data.path=chat.jsonl"], "data.pack = false"),
    ],
)
def test_bad_ring_configs_name_the_field(overrides: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=r'parallel\.cp_attention = "ring"') as err:
        load(None, ["parallel.cp_attention=ring", *overrides])
    assert named in str(err.value)


def test_unpacked_sft_and_text_are_accepted() -> None:
    sft = ["data.format=sft", "data.path=chat.jsonl", "data.pack=false"]
    cfg = load(None, ["parallel.cp_attention=ring", "parallel.cp=2", *sft])
    assert cfg.parallel.cp_attention == "ring"


def test_only_ulysses_needs_heads_that_divide_by_cp() -> None:
    assert heads_cp(cp=4, attention="ulysses") == 4 and heads_cp(cp=4, attention="ring") == 1
    shape = ["model.n_heads=2", "model.n_kv_heads=2", "parallel.cp=4"]
    with pytest.raises(ConfigError, match=r"parallel\.cp = 4 must divide the attention heads"):
        check_layout(load(None, shape))
    check_layout(load(None, [*shape, "parallel.cp_attention=ring"]))  # no error
