"""The DPO reference model in the analytic plan ([Note: reference in the plan]).

A DPO run is planned as the language-model run with two rows per pair, plus the frozen
reference's shards for the whole step (fp32 under fp32: exactly the policy's sharded
parameters; bf16 with dpo.reference_dtype = bf16: half) and its no-grad forward; under
LoRA and SimPO there is no reference at all.
"""

from __future__ import annotations

from fsdpkit.config import load
from fsdpkit.planner import Plan, plan

SHAPE = ["model.n_layers=4", "model.dim=256", "model.ffn_dim=512", "model.n_heads=4"]
RUN = [*SHAPE, "data.seq_len=128", "train.micro_batch_size=2", "precision.mode=fp32"]
DPO = ["train.objective=dpo", "data.path=pairs.jsonl"]


def _plan(*extra: str) -> Plan:
    return plan(load(None, [*RUN, *extra]), world_size=4, vocab_size=512, trace=False)


def test_the_reference_adds_its_shards_and_the_rows_double() -> None:
    lm = _plan("train.micro_batch_size=4", "train.chunked_loss=off")  # 2 rows x 2 pairs
    dpo = _plan(*DPO)
    assert dpo.scenario.micro_batch == lm.scenario.micro_batch == 4
    assert dpo.scenario.reference_bytes == lm.memory.model_states["sharded_params"]
    assert dpo.memory.peak.breakdown["reference"] == dpo.scenario.reference_bytes
    assert dpo.memory.peak.bytes == lm.memory.peak.bytes + dpo.scenario.reference_bytes
    half = _plan(*DPO, "dpo.reference_dtype=bf16")
    assert 2 * half.scenario.reference_bytes == dpo.scenario.reference_bytes


def test_lora_and_simpo_plan_no_reference() -> None:
    for extra in (["lora.rank=8"], ["dpo.loss=simpo"]):
        p = _plan(*DPO, *extra)
        assert p.scenario.micro_batch == 4 and p.scenario.reference_bytes == 0
        assert p.memory.peak.breakdown.get("reference", 0) == 0
