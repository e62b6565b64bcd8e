"""Selective activation checkpointing's policy ([Note: selective checkpointing]), single
process: which ops are saved, forward and recompute agreeing on blocks with an odd
number of matmuls, gradients equal to no checkpointing on the built-in Llama block and
on a transformers Llama; the planner's saved set and the recommender's choice."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fsdpkit.config import ActivationsConfig, ConfigError, RunConfig, TrainConfig, load
from fsdpkit.models.llama import Llama, LlamaConfig
from fsdpkit.planner import parse_device, plan
from fsdpkit.planner.replay.blockmem import (
    ACT,
    TEMP,
    Sizes,
    block_backward,
    block_forward,
    block_recompute,
    selective_backward_end,
    selective_saved,
)
from fsdpkit.planner.search.recommend import recommend
from fsdpkit.planner.search.stepcost import recompute_fraction
from fsdpkit.planner.shapes.scenario import scenario
from fsdpkit.sharding.activations import (
    SelectivePolicy,
    checkpoint_forward,
    checkpoint_kwargs,
    is_checkpointed,
    op_decision,
)
from fsdpkit.sharding.units import unit_specs

aten = torch.ops.aten
SELECTIVE = ActivationsConfig(mode="selective")
SELECTIVE_KEY = "activations.mode=selective"


class OddBlock(nn.Module):
    """Three square matmuls (odd), each output the same shape: a recompute that lost
    count would pop another matmul's saved output without any shape error."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(dim, dim, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.c(F.gelu(self.b(torch.tanh(self.a(x)))))


class _Ctx:
    def __init__(self, is_recompute: bool) -> None:
        self.is_recompute = is_recompute


def test_every_other_matmul_attention_and_collectives_are_saved() -> None:
    assert [op_decision(aten.mm.default, matmul_count=k) for k in (1, 2, 3, 4)] == [
        True,
        False,
        True,
        False,
    ]
    assert op_decision(aten.addmm.default, matmul_count=1)
    assert op_decision(aten._scaled_dot_product_flash_attention_for_cpu.default, matmul_count=0)
    assert op_decision(aten._scaled_dot_product_efficient_attention.default, matmul_count=0)
    import torch.distributed._functional_collectives

    reduce_scatter = torch.ops._c10d_functional.reduce_scatter_tensor.default
    assert op_decision(reduce_scatter, matmul_count=0)
    for cheap in (aten.add.Tensor, aten.mul.Tensor, aten.rsqrt.default, aten.silu.default):
        assert not op_decision(cheap, matmul_count=0)


def test_forward_and_recompute_count_matmuls_apart() -> None:
    """Seven matmuls (a Llama block) forward, then the recompute: the recompute's
    decisions repeat the forward's instead of continuing its count."""
    policy = SelectivePolicy()
    decide = lambda recompute: policy(_Ctx(recompute), aten.mm.default)  # noqa: E731
    forward = [decide(False) for _ in range(7)]
    recompute = [decide(True) for _ in range(7)]
    assert recompute == forward
    must, prefer = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert forward == [must, prefer, must, prefer, must, prefer, must]


def _grads(model: nn.Module, fn: Callable[[nn.Module], torch.Tensor]) -> Any:
    out = fn(model)
    out.backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(a: Any, b: Any) -> None:
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=0, atol=0, msg=name)


class _Recording(SelectivePolicy):
    """The selective policy, recording each decision and whether it was a recompute."""

    calls: list[tuple[bool, Any, CheckpointPolicy]]

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        decision = super().__call__(ctx, func, *args, **kwargs)
        self.calls.append((ctx.is_recompute, func, decision))
        return decision


def test_odd_matmul_block_matches_no_checkpointing() -> None:
    torch.manual_seed(0)
    base, x = OddBlock(), torch.randn(4, 16)
    fn = lambda m: (m(x) ** 2).sum()  # noqa: E731
    reference = _grads(copy.deepcopy(base), fn)
    selective = copy.deepcopy(base)
    checkpoint_forward(selective, cfg=SELECTIVE)
    assert list(selective.state_dict()) == list(base.state_dict())
    _assert_same(_grads(selective, fn), reference)


def test_each_checkpointed_call_gets_fresh_counters() -> None:
    """Two odd blocks in a row save the same matmuls (1st and 3rd of each): a policy
    shared between calls would continue the count (the second block saving its 2nd).
    On torch 2.13 the recompute replays the forward's recorded decisions and never
    asks the policy ([Note: selective checkpointing]): all calls are forward calls."""
    policies: list[_Recording] = []

    def context() -> Any:
        policies.append(_Recording())
        policies[-1].calls = []
        return create_selective_checkpoint_contexts(policies[-1])

    torch.manual_seed(0)
    first, second = OddBlock(), OddBlock()
    for block in (first, second):
        checkpoint(block, context_fn=context)
    (second(first(torch.randn(4, 16))) ** 2).sum().backward()
    assert len(policies) == 2
    must = CheckpointPolicy.MUST_SAVE
    for policy in policies:
        mms = [d == must for _, f, d in policy.calls if f == aten.mm.default]
        assert mms == [True, False, True]
        assert not any(recompute for recompute, _, _ in policy.calls)


TINY = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)


def _llama_loss(logits: Any) -> torch.Tensor:
    logits = getattr(logits, "logits", logits)
    return logits.float().logsumexp(-1).mean()


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "document-mask"])
def test_llama_blocks_match_no_checkpointing(packed: bool) -> None:
    """Seven matmuls per block; SDPA as the CPU flash kernel (causal) or the masked
    path (packed rows with position ids)."""
    torch.manual_seed(0)
    base = Llama(TINY)
    x = torch.randint(0, 64, (2, 16))
    pos = torch.cat([torch.arange(8), torch.arange(8)]).expand(2, 16) if packed else None
    fn = lambda m: _llama_loss(m(x, pos))  # noqa: E731
    model = copy.deepcopy(base)
    for block in model.model.layers:
        checkpoint_forward(block, cfg=SELECTIVE)
    _assert_same(_grads(model, fn), _grads(copy.deepcopy(base), fn))


def test_hf_llama_blocks_match_no_checkpointing() -> None:
    transformers = pytest.importorskip("transformers")
    from tiny_hf import tiny_config

    torch.manual_seed(0)
    config = tiny_config("llama", vocab_size=64, dim=32)
    config.use_cache = False  # as fsdpkit.models.hf.construct builds it: a cache grows on recompute
    base = transformers.LlamaForCausalLM(config)
    x = torch.randint(0, 64, (2, 16))
    fn = lambda m: _llama_loss(m(x))  # noqa: E731
    reference = _grads(copy.deepcopy(base), fn)
    model = copy.deepcopy(base)
    for block in model.model.layers:
        checkpoint_forward(block, cfg=SELECTIVE)
    _assert_same(_grads(model, fn), reference)


def test_selective_checkpoints_every_block_and_parses() -> None:
    cfg = ActivationsConfig(mode="selective")
    assert all(is_checkpointed(i, cfg) for i in range(5))
    specs = unit_specs(4, parallel=RunConfig().parallel, activations=cfg)
    assert all(all(s.checkpointed) for s in specs[:-1])
    assert checkpoint_kwargs(ActivationsConfig(mode="full")) == {}
    assert set(checkpoint_kwargs(cfg)) == {"context_fn"}
    run = load(None, ["activations.mode=selective", "train.compile=true"])
    assert run.activations.mode == "selective" and run.train.compile
    assert TrainConfig().compile is False


def test_selective_refuses_norm_units_inside_blocks() -> None:
    """precision.norms_fp32 makes FSDP units of the norms inside each block; their
    hooks run other ops in the recompute (measured: "_record_function_enter_new
    invocation index 12 ... not found in storage"), so the config is refused."""
    with pytest.raises(ConfigError, match="norms_fp32"):
        load(None, [SELECTIVE_KEY, "precision.mode=bf16", "precision.norms_fp32=true"])
    load(None, ["activations.mode=full", "precision.mode=bf16", "precision.norms_fp32=true"])


# ------------------------------------------------------------------ planner


def _net(events: list[tuple[str, int]], category: str = ACT) -> int:
    return sum(n for c, n in events if c == category)


SPLITS = {
    "dp": {},
    "tp2": {"tp": 2, "n": 32, "inner_n": 64},
    "cp2": {"cp": 2},
    "tp2 x cp2": {"tp": 2, "cp": 2, "n": 32, "inner_n": 64},
    "ring": {"cp": 2, "ring": True},
    "hf cp2": {"cp": 2, "block_positions": True},
}
"""Sizes of a tp / cp rank's block (heads, kv heads and f are divided by tp below)."""


@pytest.mark.parametrize("split", list(SPLITS.values()), ids=list(SPLITS))
@pytest.mark.parametrize("e", [4, 2], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv_heads", [2, 8], ids=["gqa", "mha"])
def test_selective_block_keeps_its_saved_outputs(
    e: int, kv_heads: int, split: dict[str, Any]
) -> None:
    """Forward keeps exactly ``selective_saved`` more than full checkpointing, and
    forward + recompute + backward leave the same activations behind as full."""
    tp = split.get("tp", 1)
    base = {"n": 64, "d": 128, "head_dim": 16, "vocab": 100, "e": e}
    s = Sizes(**base | split, f=344 // tp, heads=8 // tp, kv_heads=kv_heads // tp)
    full_fwd = block_forward(s, keep=False)
    sel_fwd = block_forward(s, keep=False, selective=True)
    assert _net(sel_fwd) - _net(full_fwd) == selective_saved(s)
    for category in (TEMP,):
        assert _net(sel_fwd, category) == _net(full_fwd, category) == 0
    full = full_fwd + block_recompute(s) + block_backward(s)
    sel = sel_fwd + block_recompute(s, selective=True) + block_backward(s)
    sel += selective_backward_end(s)
    assert _net(sel) == _net(full) and _net(sel, TEMP) == _net(full, TEMP)


def test_selective_tp_cp_block_keeps_its_collectives_outputs() -> None:
    """[Note: selective checkpointing of exchanges]: under tp2 x cp2 (sequence
    parallelism, Ulysses) a selective block also keeps the two gathered norm outputs
    (m tokens), o_proj's and down_proj's reduce-scattered outputs (n tokens) and the
    four all-to-alls' outputs: q, k and v (the one kv head per tp rank repeated to two,
    so that it divides by cp) and attention's output. Without them the plan read
    -21% of "MP A tp2 x cp2 selective"'s real peak (bench/plan_accuracy.py)."""
    m, n, d, hd = 512, 256, 256, 64  # model A's rank: 1024 tokens / cp, / tp on the stream
    s = Sizes(
        n=n, inner_n=m, d=d, f=344, heads=2, kv_heads=1, head_dim=hd, vocab=1, e=4, tp=2, cp=2
    )
    matmuls = 2 * m * 2 * hd * 4 + m * hd * 4 + 4 * m * 2 + m * 344 * 4 + m * d * 4
    gathers, scatters = 2 * m * d * 4, 2 * n * d * 4
    exchanges = m * 2 * hd * 4 * 2 + 2 * (m * 2 * hd * 4)  # q, out; k, v at 2 heads
    assert selective_saved(s) == matmuls + gathers + scatters + exchanges
    assert s.nxe == 2 * s.nke
    kept = _net(block_forward(s, keep=False, selective=True)) - _net(block_forward(s, keep=False))
    assert kept == selective_saved(s)
    # down_proj's output and its reduce-scattered copy, never taken by the recompute,
    # stay to the end of the block's backward
    assert selective_backward_end(s) == [(ACT, -(m * d * 4 + n * d * 4))]
    # ring attention: its exchanges run inside one attention op, nothing is added
    ring = replace(s, tp=1, n=m, inner_n=0, ring=True)
    assert selective_saved(ring) == matmuls


def _peak(mode: str, *overrides: str) -> Any:
    cfg = load(
        None,
        [
            "model.preset=llama3-8b", "data.seq_len=8192", "train.micro_batch_size=1",
            "precision.mode=bf16", f"activations.mode={mode}", *overrides,
        ],
    )  # fmt: skip
    return plan(cfg, world_size=8, device=parse_device("h100"))


def test_llama3_8b_selective_lies_between_none_and_full() -> None:
    """Per block, selective keeps its input plus q, v, attention's output and lse,
    gate and down: 497 MiB at 8192 tokens in bf16 (x32 blocks = 15.5 GiB)."""
    none, sel, full = (_peak(m).memory.peak.bytes for m in ("none", "selective", "full"))
    assert full < sel < none
    s = Sizes(n=8192, d=4096, f=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256, e=2)
    assert selective_saved(s) + s.nde == 497 * 2**20  # 128 + 16 + 1 + 224 + 64, + x 64


def test_recommender_searches_selective_and_prices_its_recompute() -> None:
    cfg = load(
        None,
        [
            "model.preset=llama3-8b", "data.seq_len=8192", "train.micro_batch_size=2",
            "precision.mode=bf16",
        ],
    )  # fmt: skip
    rec = recommend(cfg, world_size=8, device=parse_device("h100"), top=50)
    assert rec.best is not None
    assert rec.best.changes == {"activations.mode": "selective"}
    full = next(c for c in rec.ranked if c.changes == {"activations.mode": "full"})
    assert 0 < rec.best.cost.recompute_s < full.cost.recompute_s / 2


def test_recompute_fraction_counts_the_matmuls_the_policy_recomputes() -> None:
    """k, o and up of llama3-8b's block (79.7M of 218.1M weights) over the block's
    forward with attention at 8192 tokens (+67.1M per token / 2): 0.279."""
    sel, full = (_peak(m) for m in ("selective", "full"))
    cfg = load(None, ["model.preset=llama3-8b", "data.seq_len=8192", SELECTIVE_KEY])
    sc = scenario(cfg, world_size=8, device=parse_device("h100"))
    assert recompute_fraction(sc) == pytest.approx(0.2794, abs=1e-3)
    assert recompute_fraction(sc.with_(ac_mode="full")) == 1.0
    assert sel.memory.peak.bytes > full.memory.peak.bytes
