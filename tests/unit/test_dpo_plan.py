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


def _plan(*extra: str, world: int = 4) -> Plan:
    return plan(load(None, [*RUN, *extra]), world_size=world, vocab_size=512, trace=False)


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


def test_the_reference_is_split_like_the_policy_under_tp_and_cp() -> None:
    """Its shards are the policy's tp-local ones (/ tp for the blocks); under cp its
    forward's logits are those of seq / cp tokens per rank."""
    lm_tp = _plan("train.micro_batch_size=4", "train.chunked_loss=off", "parallel.tp=2")
    dpo_tp = _plan(*DPO, "parallel.tp=2")
    whole = _plan(*DPO, world=2).scenario.reference_bytes  # the same 2 FSDP ranks, tp = 1
    assert dpo_tp.scenario.reference_bytes == lm_tp.memory.model_states["sharded_params"]
    assert whole / 2 < dpo_tp.scenario.reference_bytes < whole  # blocks / 2, head / embedding not
    cp1, cp2 = _plan(*DPO).scenario, _plan(*DPO, "parallel.cp=2").scenario
    assert cp2.reference_bytes == cp1.reference_bytes  # FSDP shards over shard x cp = 4 alike
    logits = 4 * 128 * 512 * (4 + 4)  # 2 pairs = 4 rows x seq 128 x vocab 512, fp32 + log-probs
    assert cp1.reference_forward - cp2.reference_forward == logits // 2
