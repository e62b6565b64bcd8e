"""Chunked linear cross-entropy: the function, the loss a run chooses, the planner's model.

The function against ``F.cross_entropy`` on full logits (value and every gradient, an
ignore index, chunks that do not divide the tokens, a frozen head, bf16); the
``ChunkedLoss`` against ``next_token_loss`` / ``sft_loss`` on the built-in Llama in one
process; ``train.chunked_loss`` resolution (auto, on, off, unsupported models); the
planner's loss buffers, including the llama3-8b case of issue 12.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fsdpkit.config import load
from fsdpkit.data.batch import IGNORE_INDEX, SFTBatch
from fsdpkit.devices import parse_device
from fsdpkit.errors import ConfigError
from fsdpkit.loss.answers import sft_loss
from fsdpkit.loss.chunked_ce import chunked_linear_cross_entropy
from fsdpkit.loss.contract import next_token_loss
from fsdpkit.loss.head import ChunkedLoss, HeadLossError, choose_loss, output_head
from fsdpkit.planner import plan
from fsdpkit.planner.errors import PlanError
from fsdpkit.planner.shapes.scenario import scenario
from support import TINY, build, build_mlp, needs_cxx

GiB = 1024**3


def _inputs(n: int = 37, d: int = 16, v: int = 50, *, bias: bool = True) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, d, generator=g, requires_grad=True)
    w = torch.randn(v, d, generator=g, requires_grad=True)
    b = torch.randn(v, generator=g, requires_grad=True) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[::4] = IGNORE_INDEX
    return [h, w, b, t]  # type: ignore[list-item]


@pytest.mark.parametrize("chunk", [1, 5, 8, 37, 1000])
def test_value_and_grads_equal_cross_entropy_on_full_logits(chunk: int) -> None:
    h, w, b, t = _inputs()
    ref = F.cross_entropy(F.linear(h, w, b).float(), t, reduction="sum")
    want = torch.autograd.grad(ref, (h, w, b))
    got = chunked_linear_cross_entropy(h, w, b, t, chunk_tokens=chunk)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)
    # atol is set by the largest gradients (up to 15 here: 1e-5 is ~6 fp32 ulps of
    # them), not by the element compared: an element near zero is a sum of terms that
    # size cancelling, so a different summation order (one chunk per token, or another
    # CPU's kernels) leaves ~2e-6 there (seen on one machine at chunk 1)
    for a, e in zip(torch.autograd.grad(got * 3.0, (h, w, b)), want, strict=True):
        torch.testing.assert_close(a, 3.0 * e, rtol=1e-5, atol=1e-5)


def test_ignored_targets_have_no_loss_and_no_gradient() -> None:
    h, w, _, t = _inputs(bias=False)
    t[:] = IGNORE_INDEX
    t[3] = 7
    got = chunked_linear_cross_entropy(h, w, None, t, chunk_tokens=4)
    ref = F.cross_entropy(h[3:4] @ w.t(), t[3:4], reduction="sum")
    torch.testing.assert_close(got, ref)
    (gh,) = torch.autograd.grad(got, (h,))
    assert gh[3].abs().sum() > 0
    assert torch.count_nonzero(gh[torch.arange(len(t)) != 3]) == 0


def test_frozen_head_gets_no_gradient_and_3d_hidden_is_flattened() -> None:
    h, w, _, t = _inputs(n=24, bias=False)
    w.requires_grad_(False)
    got = chunked_linear_cross_entropy(
        h.reshape(2, 12, -1), w, None, t.reshape(2, 12), chunk_tokens=5
    )
    got.backward()
    assert w.grad is None and h.grad is not None
    ref = F.cross_entropy(h @ w.t(), t, reduction="sum")
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)


def test_bf16_logits_and_fp32_softmax_like_the_full_path() -> None:
    h, w, _, t = _inputs(n=64, d=32, v=300, bias=False)
    hb, wb = (x.detach().bfloat16().requires_grad_() for x in (h, w))
    ref = F.cross_entropy((hb @ wb.t()).float(), t, reduction="sum")
    want = torch.autograd.grad(ref, (hb, wb))
    got = chunked_linear_cross_entropy(hb, wb, None, t, chunk_tokens=10)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-3)  # fp32 sums, other order
    for a, e in zip(torch.autograd.grad(got, (hb, wb)), want, strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), e.float(), rtol=2e-2, atol=2e-2)


def test_chunked_loss_equals_next_token_loss_on_llama() -> None:
    torch.manual_seed(0)
    tokens = torch.randint(0, TINY.vocab_size, (2, 17))
    for tied in (True, False):
        model = build(replace(TINY, tie_embeddings=tied))
        ref = next_token_loss(model, tokens)
        want = torch.autograd.grad(ref, list(model.parameters()))
        got = ChunkedLoss(chunk_tokens=7)(model, tokens)
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
        for a, e in zip(torch.autograd.grad(got, list(model.parameters())), want, strict=True):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-7)
        assert "forward" not in vars(model.lm_head) and not model._forward_hooks


def test_chunked_loss_equals_sft_loss_with_mask_positions_and_normalizer() -> None:
    torch.manual_seed(1)
    model = build()
    inputs = torch.randint(0, TINY.vocab_size, (2, 16))
    targets = torch.randint(0, TINY.vocab_size, (2, 16))
    targets[:, :5] = IGNORE_INDEX
    positions = torch.arange(8).repeat(2).expand(2, -1).contiguous()
    for normalizer in (None, 13.0):
        batch = SFTBatch(inputs, targets, positions, normalizer=normalizer)
        ref = sft_loss(model, batch)
        got = ChunkedLoss(chunk_tokens=3)(model, batch)
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
        g_ref = torch.autograd.grad(ref, [model.lm_head.weight])[0]
        g_got = torch.autograd.grad(got, [model.lm_head.weight])[0]
        torch.testing.assert_close(g_got, g_ref, rtol=1e-5, atol=1e-6)


class _Scaled(nn.Module):
    """A model that post-processes its head's output (as soft-capping models do)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = build()
        self.lm_head = self.inner.lm_head

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner(tokens) * 0.5


def test_a_model_that_changes_the_head_output_is_refused_not_mistrained() -> None:
    model = _Scaled()
    with pytest.raises(HeadLossError, match=r"train\.chunked_loss"):
        ChunkedLoss()(model, torch.randint(0, TINY.vocab_size, (1, 9)))
    assert "forward" not in vars(model.lm_head) and not model._forward_hooks


def _choose(model: nn.Module, mode: str, *, custom: bool = False):  # type: ignore[no-untyped-def]
    return choose_loss(
        model, mode=mode, chunk_tokens=64, default=next_token_loss, custom_loss=custom
    )


def test_auto_is_on_for_a_plain_linear_head_and_off_means_full_logits() -> None:
    model = build()
    assert output_head(model) is model.lm_head
    auto = _choose(model, "auto")
    assert auto.chunked and auto.note is None and auto.loss_fn == ChunkedLoss(chunk_tokens=64)
    off = _choose(model, "off")
    assert not off.chunked and off.loss_fn is next_token_loss


def test_unsupported_models_fall_back_under_auto_and_fail_under_on() -> None:
    mlp = build_mlp()  # its head is named `head`, with no get_output_embeddings()
    auto = _choose(mlp, "auto")
    assert not auto.chunked and auto.loss_fn is next_token_loss
    assert auto.note is not None and "no plain nn.Linear output head" in auto.note
    with pytest.raises(ConfigError, match=r"train\.chunked_loss = on"):
        _choose(mlp, "on")
    custom = _choose(build(), "auto", custom=True)
    assert not custom.chunked and "own loss_fn" in (custom.note or "")


def test_hf_models_by_their_config(tmp_path: object) -> None:
    transformers = pytest.importorskip("transformers")
    from tiny_hf import tiny_config

    llama = transformers.LlamaForCausalLM(tiny_config("llama", vocab_size=64, dim=32))
    assert _choose(llama, "auto").chunked
    gemma2 = transformers.Gemma2ForCausalLM(tiny_config("gemma2", vocab_size=64, dim=32))
    fallback = _choose(gemma2, "auto")
    assert not fallback.chunked and "final_logit_softcapping" in (fallback.note or "")


def test_loss_chunk_tokens_must_be_positive() -> None:
    with pytest.raises(ConfigError, match=r"train\.loss_chunk_tokens"):
        load(None, ["train.loss_chunk_tokens=0"])


LLAMA3_8B = [
    "model.preset=llama3-8b", "data.seq_len=8192", "train.micro_batch_size=2",
    "activations.mode=full", "precision.mode=bf16",
]  # fmt: skip


def test_llama3_8b_chunked_loss_drops_the_logits() -> None:
    h100 = parse_device("h100")
    full = plan(load(None, [*LLAMA3_8B, "train.chunked_loss=off"]), world_size=8, device=h100)
    chunked = plan(load(None, LLAMA3_8B), world_size=8, device=h100)  # auto = on
    assert chunked.scenario.loss_chunk == 1024
    # the 41.70 GiB, less the untied embedding and head in the root unit
    # ([Note: edge units] in fsdpkit.sharding.edges)
    assert full.memory.peak.bytes == pytest.approx(40.72 * GiB, abs=0.01 * GiB)
    # What is left of the loss: one chunk's logits, fp32 copy and logsumexp temp in
    # forward; the peak moves into a block's backward (docs/levers-loss.md)
    assert chunked.memory.peak.bytes < full.memory.peak.bytes - 17 * GiB
    assert chunked.memory.peak.breakdown["logits_loss"] < 0.02 * GiB
    assert "layers" in chunked.memory.peak.where


def _peak(*overrides: str) -> int:
    cfg = load(
        None, ["precision.mode=fp32", "data.seq_len=512", "model.vocab_size=8192", *overrides]
    )
    return plan(cfg, world_size=2).memory.peak.bytes


def test_smaller_chunks_plan_less_memory_and_full_logits_the_most() -> None:
    peaks = [_peak(f"train.loss_chunk_tokens={c}") for c in (64, 256, 1024)]
    assert peaks == sorted(peaks)
    assert peaks[-1] < _peak("train.chunked_loss=off")


def test_a_lora_wrapped_head_is_planned_with_full_logits() -> None:
    pytest.importorskip("peft")
    lora = ["lora.rank=4", 'lora.targets=["q_proj","lm_head"]']
    sc = scenario(load(None, lora), world_size=2)
    assert sc.loss_chunk is None and any("LoRA" in n for n in sc.notes)
    with pytest.raises(PlanError, match=r"train\.chunked_loss = on"):
        scenario(load(None, [*lora, "train.chunked_loss=on"]), world_size=2)


def test_the_plan_report_shows_the_loss_buffers_of_the_chosen_mode() -> None:
    from fsdpkit.planner.formatting import format_plan

    n, v = 2 * 8192, 128256
    on = plan(load(None, LLAMA3_8B), world_size=8)
    assert on.loss is not None and on.loss.chunk == 1024
    # saved lse + targets, then one chunk's bf16 logits and their fp32 copy
    assert on.loss.chosen == 12 * n + 1024 * v * (2 + 4)
    assert on.loss.full == 3 * n * v * 4  # log-probs, nll's grad, log-softmax's grad
    assert "chunked cross-entropy, 1024-token chunks; full logits would take 23.48 GiB" in (
        format_plan(on)
    )
    off = plan(load(None, [*LLAMA3_8B, "train.chunked_loss=off"]), world_size=8)
    assert "loss buffers per micro-batch: 23.48 GiB (full logits)" in format_plan(off)


@pytest.mark.parametrize("e", [4, 2])
@pytest.mark.parametrize("n", [32, 4096])
def test_chunked_never_needs_more_than_full_logits(e: int, n: int) -> None:
    # train.chunked_loss = auto is on without planning because of this: even when one
    # chunk holds every token and the head's weight grad dwarfs the logits (d=2048,
    # 32 tokens), the weight grad is the first chunk's product, never beside its fp32
    from fsdpkit.planner.replay import blockmem as bm
    from fsdpkit.planner.replay import headmem as hm
    from fsdpkit.planner.replay.ledger import summarize

    s = bm.Sizes(n=n, d=2048, f=8192, heads=32, kv_heads=8, head_dim=64, vocab=128256, e=e)
    full = hm.head_forward(s) + hm.loss_forward(s) + hm.loss_backward(s) + hm.head_backward(s)
    for chunk in (16, 1024, 8192):
        chunked = hm.chunked_head_forward(s) + hm.chunked_loss_forward(s, chunk=chunk)
        chunked += hm.chunked_loss_backward(s, chunk=chunk)
        # at most the saved log-sum-exp and targets (12 bytes per token) more
        assert summarize(chunked).peak <= summarize(full).peak + 12 * n, chunk
        assert summarize(chunked).net == summarize(full).net  # the same state after


@pytest.mark.parametrize("tied", [True, False])
def test_grad_into_weight_leaves_the_same_gradient(tied: bool) -> None:
    # two micro-batches: the second sums into an accumulated .grad after the
    # embedding's gradient is in ([Note: the head's gradient under fake tensors])
    grads = []
    for into in (False, True):
        emb = nn.Embedding(50, 16)
        head = emb.weight if tied else nn.Parameter(torch.zeros(50, 16))
        with torch.no_grad():
            emb.weight.copy_(torch.randn(50, 16, generator=torch.Generator().manual_seed(0)))
            head.copy_(torch.randn(50, 16, generator=torch.Generator().manual_seed(1)))
        for micro in range(2):
            tokens = (torch.arange(24).reshape(2, 12) * (micro + 1)) % 50
            loss = chunked_linear_cross_entropy(
                emb(tokens[:, :-1]), head, None, tokens[:, 1:], chunk_tokens=4,
                grad_into_weight=into,
            )  # fmt: skip
            loss.backward()
        assert not head._post_accumulate_grad_hooks  # each hook removed itself
        grads.append((emb.weight.grad, head.grad))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-6, atol=1e-7)


@needs_cxx
@pytest.mark.slow  # inductor compiles two kernels per dtype (~8 s on 2 cores)
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-3)])
def test_compiled_chunks_equal_eager_ones(dtype: torch.dtype, tol: float) -> None:
    """[Note: compiling the chunk]: the same loss and gradients (bf16: inductor keeps the
    fused softmax gradient in fp32 until one cast, eager rounds per op)."""
    torch.manual_seed(0)
    h = torch.randn(300, 64, dtype=dtype, requires_grad=True)
    w = (torch.randn(1000, 64) * 0.1).to(dtype).requires_grad_()
    targets = torch.randint(0, 1000, (300,))
    targets[::7] = IGNORE_INDEX
    out = []
    for compiled in (False, True):
        h.grad = w.grad = None
        loss = chunked_linear_cross_entropy(
            h, w, None, targets, chunk_tokens=128, compiled=compiled
        )
        loss.backward()
        assert h.grad is not None and w.grad is not None
        out.append([loss.detach().float(), h.grad.float(), w.grad.float()])
    for eager, compiled_ in zip(*out):
        torch.testing.assert_close(compiled_, eager, rtol=tol, atol=tol * eager.abs().max())


def test_choose_loss_compiles_the_chunks_when_asked() -> None:
    """(The trainer asks under train.compile in bf16/fp16: fsdpkit.train.session.)"""
    model = build(TINY)
    kw = {"mode": "auto", "chunk_tokens": 64, "default": next_token_loss, "custom_loss": False}
    assert choose_loss(model, **kw, compiled=True).loss_fn == ChunkedLoss(64, compiled=True)
    assert choose_loss(model, **kw).loss_fn == ChunkedLoss(64)
