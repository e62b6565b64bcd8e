"""Context parallelism ([Note: Ulysses context parallelism], fsdpkit.sharding.context.attention):
the all-to-all exchange against full attention, and whole models at cp2 against the
unsharded model, on gloo.

Two spawns: 4 ranks for the exchange (one cp4 group; and a 2 x 2 mesh whose cp2
groups hold different data), 2 ranks for the models (the built-in Llama, a
transformers Llama and Qwen2; plain token batches and packed SFT rows whose examples
cross the cp slice boundary). No FSDP: every rank holds the whole model (same seed)
and the gradients are summed over cp and divided by cp, which is FSDP's reduce over
its dp x cp ranks ([Note: context-parallel loss normalization]).
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fsdpkit.data.batch import IGNORE_INDEX, SFTBatch
from fsdpkit.errors import ConfigError
from fsdpkit.loss.answers import sft_loss
from fsdpkit.loss.contract import logits_of, next_token_loss
from fsdpkit.models.llama import causal_attention, document_mask
from fsdpkit.sharding.context.attention import (
    HF_ATTENTION,
    UlyssesAttention,
    apply_context_parallel,
    check_cp_heads,
    gather_positions,
    local_attention,
)
from fsdpkit.sharding.context.batch import context_parallel_loss, slice_batch
from fsdpkit.testing import run_ranks
from support import TINY, build

pytestmark = pytest.mark.distributed

SEQ = 16
PACKED = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]] * 2)
"""Three examples per row (5, 6, 5 tokens): the middle one crosses the cp2 and cp4
slice boundaries, so a rank's own positions cannot give its mask."""
SHAPES = {"mha": (4, 4), "gqa": (4, 2), "gqa-repeat": (8, 2)}
"""(query heads, kv heads); at cp4 "gqa-repeat" repeats its 2 kv heads to 4."""


def _exchange_case(mesh: Any, *, heads: tuple[int, int], packed: bool) -> dict[str, float]:
    cp, rank = mesh.size(), mesh.get_local_rank()
    group_index = dist.get_rank() // cp  # the cp groups of dp2 x cp2 hold different data
    g = torch.Generator().manual_seed(11 + heads[0] + heads[1] + 100 * group_index)
    b, d = 2, 8
    q, k, v = (torch.randn(b, h, SEQ, d, generator=g) for h in (heads[0], heads[1], heads[1]))
    up = torch.randn(b, heads[0], SEQ, d, generator=g)
    positions = PACKED if packed else torch.arange(SEQ).expand(b, SEQ)
    mask = document_mask(PACKED) if packed else None
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = causal_attention(*ref_in, mask=mask)
    (ref * up).sum().backward()
    part = slice(rank * SEQ // cp, (rank + 1) * SEQ // cp)
    local = [t[:, :, part].clone().requires_grad_() for t in (q, k, v)]
    full_pos = gather_positions(positions[:, part], group=mesh.get_group())
    out = UlyssesAttention(group=mesh.get_group(), cp=cp)(*local, mask=document_mask(full_pos))
    (out * up[:, :, part]).sum().backward()
    diffs = {"out": (out - ref[:, :, part]).abs().max().item()}
    for name, a, r in zip("qkv", local, ref_in):
        assert a.grad is not None and r.grad is not None
        diffs[f"d{name}"] = (a.grad - r.grad[:, :, part]).abs().max().item()
    diffs["positions"] = float(not torch.equal(full_pos, positions))
    return diffs


def _exchange(rank: int, world: int) -> dict[str, dict[str, float]]:
    meshes = {
        "cp4": init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))["cp"],
        "dp2xcp2": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))["cp"],
    }
    out = {}
    for mesh_name, mesh in meshes.items():
        for shape, heads in SHAPES.items():
            for packed in (False, True):
                key = f"{mesh_name}/{shape}/{'packed' if packed else 'causal'}"
                out[key] = _exchange_case(mesh, heads=heads, packed=packed)
    return out


@pytest.fixture(scope="module")
def exchange() -> dict[str, dict[str, float]]:
    results = run_ranks(_exchange, world_size=4, timeout_s=240)
    worst: dict[str, dict[str, float]] = {}
    for per_rank in results:
        for key, diffs in per_rank.items():
            for name, value in diffs.items():
                worst.setdefault(key, {})[name] = max(worst.get(key, {}).get(name, 0.0), value)
    print({key: max(d.values()) for key, d in worst.items()})
    return worst


CASES = [f"{m}/{s}/{k}" for m in ("cp4", "dp2xcp2") for s in SHAPES for k in ("causal", "packed")]


@pytest.mark.parametrize("case", CASES)
def test_exchange_equals_full_attention(exchange: dict[str, dict[str, float]], case: str) -> None:
    diffs = exchange[case]
    assert diffs.pop("positions") == 0.0, "gathered positions are not the whole sequence's"
    assert max(diffs.values()) <= 1e-6, f"{case}: {diffs}"


# --- whole models at cp2 -----------------------------------------------------------------


def _sft_batch(vocab: int) -> SFTBatch:
    g = torch.Generator().manual_seed(5)
    inputs = torch.randint(0, vocab, (2, SEQ), generator=g)
    targets = torch.randint(0, vocab, (2, SEQ), generator=g)
    targets[:, :3] = IGNORE_INDEX  # a prompt, more of it on the first cp rank
    targets[PACKED == 0] = IGNORE_INDEX  # each example's first token
    return SFTBatch(inputs=inputs, targets=targets, positions=PACKED, normalizer=7.5)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _parity(model: torch.nn.Module, mesh: Any, batch: Any, loss_fn: Any) -> dict[str, float]:
    """|loss - unsharded| and the largest |grad - unsharded| of ``model`` at cp."""
    ref = copy.deepcopy(model)
    ref_loss = loss_fn(ref, batch)
    ref_loss.backward()
    switched = apply_context_parallel(model, mesh=mesh)
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", "core")
    loss = context_parallel_loss(loss_fn, mesh=mesh)(model, batch)
    loss.backward()
    group, cp = mesh.get_group(), mesh.size()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss, group=group)
    grads, ref_grads = _grads(model), _grads(ref)
    assert grads.keys() == ref_grads.keys() and grads
    worst = 0.0
    for name, grad in grads.items():
        dist.all_reduce(grad, group=group)  # FSDP's gradient mean over the cp ranks
        worst = max(worst, (grad / cp - ref_grads[name]).abs().max().item())
    whole = batch if isinstance(batch, torch.Tensor) else batch.inputs
    with torch.no_grad(), local_attention(model):  # sampling: every rank runs it all
        local = logits_of(model(whole), tokens=whole) - logits_of(ref(whole), tokens=whole)
    return {
        "local": local.abs().max().item(),
        "loss": abs(mean_loss.item() / cp - ref_loss.item()),
        "grad": worst,
        "switched": switched,
        "hf_implementation": implementation,
    }


def _hf(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _models(rank: int, world: int, dirs: dict[str, str]) -> dict[str, dict[str, float]]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    tokens = torch.randint(0, 128, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    out = {}
    for name in ("llama", *dirs):
        for case, batch, loss_fn in (
            ("plain", tokens, next_token_loss),
            ("packed-sft", _sft_batch(128), sft_loss),
        ):
            model = build(TINY, seed=1) if name == "llama" else _hf(dirs[name])
            out[f"{name}/{case}"] = _parity(model, mesh, batch, loss_fn)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, float]]:
    pytest.importorskip("transformers")
    from tiny_hf import write_tiny_model

    os.environ["HF_HUB_OFFLINE"] = "1"
    tmp = tmp_path_factory.mktemp("cp-hf")
    dirs = {
        f"hf-{arch}": str(
            write_tiny_model(tmp / arch, arch=arch, vocab_size=128, dim=32, tokenizer=False)
        )
        for arch in ("llama", "qwen2")
    }
    results = run_ranks(_models, world_size=2, args=(dirs,), timeout_s=300)
    print({case: (d["loss"], d["grad"]) for case, d in results[0].items()})
    return results[0]  # type: ignore[no-any-return]


MODEL_CASES = [
    f"{m}/{b}" for m in ("llama", "hf-llama", "hf-qwen2") for b in ("plain", "packed-sft")
]


@pytest.mark.parametrize("case", MODEL_CASES)
def test_model_at_cp2_matches_unsharded(models: dict[str, dict[str, float]], case: str) -> None:
    diffs = models[case]
    hf = case.startswith("hf-")
    assert diffs["switched"] == (2 if hf else TINY.n_layers), "every attention layer switched"
    assert diffs["hf_implementation"] == (HF_ATTENTION if hf else "core")
    assert diffs["loss"] <= 1e-5 and diffs["grad"] <= 1e-5, f"{case}: {diffs}"
    assert diffs["local"] <= 1e-5, f"{case}: local_attention differs from the model's own"


# --- the batch split and the refusals (no process group) ---------------------------------


def test_slices_normalize_to_the_unsharded_loss_sum() -> None:
    """Per-token losses summed over the slices, each over its normalizer / cp, are cp x
    the unsharded loss, for SFT (given normalizer), plain tokens and no normalizer."""
    tokens = torch.randint(0, 50, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    sft = _sft_batch(50)
    unnormalized = SFTBatch(inputs=sft.inputs, targets=sft.targets, positions=sft.positions)
    for batch, total in ((sft, 7.5), (tokens, 2 * SEQ), (unnormalized, sft.target_count())):
        for cp in (2, 4):
            parts = [slice_batch(batch, rank=r, cp=cp) for r in range(cp)]
            assert all(p.normalizer == total / cp for p in parts)
            assert all(p.inputs.shape == (2, SEQ // cp) for p in parts)
            positions = torch.cat([p.positions for p in parts], dim=1)  # type: ignore[misc]
            expected = PACKED if isinstance(batch, SFTBatch) else torch.arange(SEQ).expand(2, -1)
            assert torch.equal(positions, expected)
            full = batch if isinstance(batch, SFTBatch) else slice_batch(batch, rank=0, cp=1)
            assert torch.equal(torch.cat([p.targets for p in parts], dim=1), full.targets)


def test_bad_layouts_name_parallel_cp() -> None:
    check_cp_heads(n_heads=8, cp=2, tp=2)
    with pytest.raises(ConfigError, match=r"parallel\.cp = 4 .* 2 per rank at parallel\.tp = 2"):
        check_cp_heads(n_heads=4, cp=4, tp=2)
    with pytest.raises(ConfigError, match=r"parallel\.cp = 3 must divide the sequence"):
        slice_batch(torch.zeros(1, SEQ + 1, dtype=torch.long), rank=0, cp=3)
