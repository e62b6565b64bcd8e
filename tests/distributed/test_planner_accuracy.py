"""The planner's predicted per-rank peak against the true peak of real CPU ranks.

Three configurations of bench/plan_accuracy.py's matrix, two fine-tuning ones (LoRA;
frozen leading blocks) and three model.hf ones (HF Llama, GPT-2, Mixtral) train real steps on 2
gloo ranks in one spawn; the true peak is c10's process-wide allocator count (see
[Note: measuring CPU peaks]). The planner plans the quiet step, the one without a
late-freed all-gather buffer ([Note: late frees]): the lowest of the measured steps.

Measured on 2026-12-01 (3 runs of 3 steps; identical on every run): traced within
0.04% on every row (docs/planner.md: 0.1%); analytic within 0.1% on the fp32
built-in and LoRA rows, -1.0% on "bf16 full" and +1.6% on "hf llama +AC" (-0.05% since
[Note: transformers' Llama in the plan]). The bounds
are those plus a margin for the allocator's 512-byte rounding: ``TRACED_BOUND`` and
``ANALYTIC_BOUND``. The median step moved by 4.1% between runs on "bf16 full" (two of
three steps with a late free), so the median is not what the bounds are checked on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tiny_hf import write_tiny_model

from fsdpkit.config import RunConfig, load
from fsdpkit.planner import plan
from fsdpkit.planner.experts.routing import BALANCED, from_records
from fsdpkit.planner.shapes.scenario import model_shape
from fsdpkit.planner.traced.measure import measure_step_records
from fsdpkit.testing import run_ranks

pytestmark = pytest.mark.distributed

S = ["model.vocab_size=2048", "data.seq_len=128", "train.micro_batch_size=4"]
T = [
    "model.dim=128", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "model.ffn_dim=344", "model.vocab_size=1024", "data.seq_len=64", "train.micro_batch_size=2",
]  # fmt: skip
E = [
    "model.preset=moe-tiny", "model.dim=128", "model.n_layers=2", "model.experts=8",
    "model.vocab_size=2048", "data.seq_len=128", "train.micro_batch_size=2",
]  # fmt: skip
CASES = {
    "full +AC": [*S, "precision.mode=fp32", "activations.mode=full"],
    "grad_op": [*S, "precision.mode=fp32", "parallel.strategy=grad_op"],
    "bf16 full": [*T, "precision.mode=bf16"],
    # fine-tuning: LoRA (frozen base, adapters in the units), and frozen leading blocks
    # that nothing before them trains (no activations, never unsharded in backward)
    "lora": [*S, "precision.mode=fp32", "lora.rank=8"],
    # issue 37: the built-in MoE model (traced), without and with expert parallelism
    "moe": [*E, "precision.mode=fp32"],
    "moe ep2": [*E, "precision.mode=fp32", "parallel.ep=2"],
    "frozen lead +AC": [
        *S,
        "precision.mode=fp32",
        "activations.mode=full",
        'model.freeze=["model.embed_tokens.*","model.layers.[0-1].*"]',
    ],
}


EP_BOUND = {"moe ep2": 0.002}
"""Traced plan vs the quiet step where the routing sizes a rank's rows: planned at the
routing that step recorded ([Note: routing in the plan]: the busiest rank's received
rows over the layers and in its busiest layer; measured -0.0%). Planned balanced (the
default) the plan is below it by what the router sent the busiest rank over its share
(bench/plan_accuracy.py's "E moe ep2": -0.3% of the typical step)."""
STEPS = 5
"""Measured steady-state steps per configuration (the lowest is the quiet step). Five,
not three: under load gloo's late frees ([Note: late frees]) can hit every one of
three steps (a clean-clone `make test` measured "hf mixtral" +1.2 MiB over its plan on
all three, the late all-gather buffer the plan's spread covers)."""


HF = {"hf llama +AC": ("llama", True), "hf gpt2": ("gpt2", False), "hf mixtral": ("mixtral", False)}
"""model.hf directories (issue 10): HF Llama is planned analytically too, GPT-2 and
Mixtral (issue 36: grouped expert GEMMs, the router loss's gathered logits) are traced
only."""
TRACED_BOUND = 0.001
"""Traced plan vs the quiet step (measured worst 0.04%)."""
ANALYTIC_BOUND = {"bf16 full": 0.015}
"""Analytic plan vs the quiet step, where it is not within 0.2% (measured 0.1%): the
tiny bf16 model (-1.0%)."""
HF_SHAPE = {"dim": 128, "layers": 3, "heads": 4, "kv_heads": 2, "ffn": 344, "vocab_size": 2048}


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf-models")
    for arch, _ in HF.values():
        write_tiny_model(root / arch, arch=arch, weights=False, tokenizer=False, **HF_SHAPE)
    return root


def _config(name: str, hf_root: Path) -> RunConfig:
    if name in HF:
        arch, ac = HF[name]
        hf = [f"model.hf={hf_root / arch}", "data.seq_len=128", "train.micro_batch_size=2"]
        return load(
            None, [*hf, "precision.mode=fp32", f"activations.mode={'full' if ac else 'none'}"]
        )
    return load(None, CASES[name])


@pytest.fixture(scope="module")
def measured(hf_root: Path) -> dict[str, dict[str, Any]]:
    specs = [
        (name, _config(name, hf_root), None if name in HF else model_shape(_config(name, hf_root)))
        for name in [*CASES, *HF]
    ]
    per_rank = run_ranks(measure_step_records, world_size=2, args=(specs, STEPS), timeout_s=300)
    out = {}
    for name, _, _ in specs:  # each step's peak over the ranks
        steps = [max(rank[name][i]["peak"] for rank in per_rank) for i in range(STEPS)]
        quiet = steps.index(min(steps))
        out[name] = {"quiet": min(steps), "worst": max(steps), "record": per_rank[0][name][quiet]}
    return out


@pytest.mark.parametrize("name", [*CASES, *HF])
def test_planner_matches_the_measured_peak(
    measured: dict[str, dict[str, float]], hf_root: Path, name: str
) -> None:
    """The plan is of the quiet step ([Note: late frees]: gloo frees an all-gather
    buffer late on some steps); the plan's own bound, peak + spread, covers the worst."""
    true = measured[name]["quiet"]
    routing = BALANCED
    if name in EP_BOUND:  # the routing the quiet step recorded (a max over the ranks)
        routing = from_records([measured[name]["record"]], source="the quiet step")
    traced = plan(_config(name, hf_root), world_size=2, trace=True, routing=routing)
    if name not in EP_BOUND:
        assert measured[name]["worst"] <= traced.memory.peak.bytes + traced.memory.spread, name
    error = (traced.memory.peak.bytes - true) / true
    bound = EP_BOUND.get(name, TRACED_BOUND)
    assert abs(error) <= bound, (name, f"traced {error:+.3%}", traced.memory.peak, true)
    if name.startswith("moe"):
        assert traced.other is None  # the routed experts are traced only
        return
    if name in HF and HF[name][0] != "llama":
        assert traced.other is None  # no analytic model of GPT-2 blocks: traced only
        return
    assert traced.other is not None
    error = (traced.other.peak.bytes - true) / true
    assert abs(error) <= ANALYTIC_BOUND.get(name, 0.002), (name, f"analytic {error:+.3%}", true)
