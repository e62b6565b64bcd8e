"""The chunked cross-entropy with the head split by vocabulary over gloo ranks
([Note: vocabulary-parallel cross-entropy] in fsdpkit.loss.chunked_ce) equals
``F.cross_entropy`` on the whole head's logits: the value on every rank, the hidden
states' gradient (all-reduced over the ranks), and each rank's rows of the weight and
bias gradients; ignored targets, chunks that do not divide the tokens, bf16.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdpkit.data.batch import IGNORE_INDEX
from fsdpkit.loss.chunked_ce import VocabShard, chunked_linear_cross_entropy
from fsdpkit.testing import run_ranks

pytestmark = pytest.mark.distributed

WORLD = 2
CASES = {"fp32-chunk5": (torch.float32, 5), "fp32-chunk64": (torch.float32, 64)}
CASES["bf16-chunk8"] = (torch.bfloat16, 8)


def _inputs(dtype: torch.dtype, n: int = 37, d: int = 16, v: int = 50) -> list[torch.Tensor]:
    """The whole problem, the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, d, generator=g).to(dtype)
    w = torch.randn(v, d, generator=g).to(dtype)
    b = torch.randn(v, generator=g).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    t[::4] = IGNORE_INDEX
    return [h, w, b, t]


def _case(rank: int, dtype: torch.dtype, chunk: int) -> dict[str, torch.Tensor]:
    h, w, b, t = _inputs(dtype)
    rows = w.shape[0] // WORLD
    mine = slice(rank * rows, (rank + 1) * rows)
    h = h.clone().requires_grad_()
    w_local = w[mine].clone().requires_grad_()
    b_local = b[mine].clone().requires_grad_()
    shard = VocabShard(group=dist.group.WORLD, offset=rank * rows)
    loss = chunked_linear_cross_entropy(h, w_local, b_local, t, chunk_tokens=chunk, shard=shard)
    grads = torch.autograd.grad(loss * 3.0, (h, w_local, b_local))
    return {"loss": loss.detach(), "h": grads[0], "w": grads[1], "b": grads[2]}


def _all(rank: int, world: int) -> dict[str, Any]:
    return {name: _case(rank, *spec) for name, spec in CASES.items()}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_all, world_size=WORLD, timeout_s=300)


@pytest.mark.parametrize("name", list(CASES))
def test_equals_cross_entropy_of_the_whole_head(results: list[dict[str, Any]], name: str) -> None:
    dtype, _ = CASES[name]
    h, w, b, t = (x.requires_grad_() if x.is_floating_point() else x for x in _inputs(dtype))
    ref = F.cross_entropy(F.linear(h, w, b).float(), t, reduction="sum")
    want = torch.autograd.grad(ref * 3.0, (h, w, b))
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    rows = w.shape[0] // WORLD
    for rank, got in enumerate(results):
        torch.testing.assert_close(got[name]["loss"], ref.detach(), **tol)
        torch.testing.assert_close(got[name]["h"], want[0], **tol)  # the whole sum on each
        mine = slice(rank * rows, (rank + 1) * rows)
        torch.testing.assert_close(got[name]["w"], want[1][mine], **tol)
        torch.testing.assert_close(got[name]["b"], want[2][mine], **tol)
