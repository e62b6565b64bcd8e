"""GRPO in the analytic plan ([Note: the GRPO step in the plan], [Note: rollout memory]).

A GRPO plan has two phases: the rollout (the whole policy gathered, the KV cache of one
decode batch of G rows, the prefill's logits, the token draws) and the training step
(rows of prompt + completion, GRPO's loss head); its peak is the larger and it says which.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_hf import write_tiny_model

from fsdpkit.config import load
from fsdpkit.planner import Plan, parse_device, plan
from fsdpkit.planner.formatting import format_plan, plan_dict
from fsdpkit.planner.replay.rolloutmem import model_rollout, rollout_memory, scenario_rollout

SHAPE = ["model.n_layers=4", "model.dim=256", "model.ffn_dim=512", "model.n_heads=8"]
GRPO = [
    "train.objective=grpo",
    "data.path=prompts.jsonl",
    'rl.rewards=["exact"]',
    "precision.mode=fp32",
    "rl.num_generations=4",
    "rl.max_prompt_length=64",
    "rl.max_completion_length=64",
    "train.global_batch_size=16",
    "train.micro_batch_size=4",
]


def _plan(*extra: str, world: int = 2) -> Plan:
    cfg = load(None, [*SHAPE, "model.n_kv_heads=2", *GRPO, *extra])
    return plan(cfg, world_size=world, vocab_size=512, trace=False)


def _rollout(p: Plan) -> int:
    assert p.grpo is not None and p.grpo.rollout is not None
    return p.grpo.rollout.peak


def test_the_cache_the_gathered_model_and_the_logits_are_counted_exactly() -> None:
    """KV cache: G rows x (P + C) positions x layers x 2 x kv_heads x head_dim x e; the
    gathered model: every unit's all-gathered copy; the prefill logits: G x P x V x e."""
    p = _plan()
    r = p.grpo.rollout  # type: ignore[union-attr]
    terms = p.scenario.grpo
    assert r is not None and terms is not None and (terms.rows, terms.seq_len) == (4, 128)
    head_dim = 256 // 8
    assert r.kv_cache == 4 * 128 * 4 * 2 * 2 * head_dim * 4
    assert r.logits == 4 * 64 * 512 * 4
    assert r.gathered == 4 * sum(u.gathered for u in p.scenario.all_units)
    # beside them the rank holds its shards and AdamW's states, not the gradients
    assert r.breakdown["sharded_params"] == p.memory.model_states["sharded_params"]
    assert r.breakdown["optimizer_states"] == p.memory.model_states["optimizer_states"]
    assert "gradients" not in r.breakdown
    assert p.memory.phase_peaks["rollout"] == r.peak


def test_the_training_phase_is_planned_at_prompt_plus_completion_with_full_logits() -> None:
    p = _plan("train.chunked_loss=on")  # GRPO's loss takes full logits whatever is asked
    sc = p.scenario
    assert (sc.seq_len, sc.micro_batch, sc.grad_accum, sc.loss_chunk) == (128, 4, 2, None)
    assert p.grpo is not None and p.grpo.training.bytes == p.memory.phase_peaks["backward"]


@pytest.mark.parametrize(
    "change",
    ["rl.num_generations=8", "rl.max_prompt_length=128", "rl.max_completion_length=256"],
)
def test_the_rollout_grows_with_the_group_and_the_lengths(change: str) -> None:
    more = _plan(change, "train.global_batch_size=32")
    assert _rollout(more) > _rollout(_plan("train.global_batch_size=32"))


def test_the_completion_length_grows_the_cache_by_its_formula() -> None:
    short, long = _plan(), _plan("rl.max_completion_length=192")
    assert long.grpo.rollout.kv_cache == 2 * short.grpo.rollout.kv_cache  # type: ignore[union-attr]


def test_the_kl_reference_is_a_sharded_copy_in_both_phases_and_none_without_beta() -> None:
    """rl.beta > 0 without LoRA: the frozen copy's shards (and its buffers) all step,
    rollout included ([Note: reference in the plan]); rl.beta = 0: no reference."""
    kl, plain = _plan("rl.beta=0.04"), _plan()
    shards = kl.memory.model_states["sharded_params"] + kl.scenario.layout.buffer_bytes
    assert kl.scenario.reference_bytes == shards
    assert plain.scenario.reference_bytes == 0
    assert _rollout(kl) - _rollout(plain) == shards
    assert kl.grpo.rollout.breakdown["reference"] == shards  # type: ignore[union-attr]
    assert kl.scenario.reference_forward > 0 and plain.scenario.reference_forward == 0
    assert "KL reference model" in format_plan(kl)


def test_lora_plans_no_second_model_for_the_kl_term() -> None:
    p = _plan("rl.beta=0.04", "lora.rank=8")
    assert p.scenario.reference_bytes == 0 and p.scenario.reference_forward == 0
    assert any("adapters off" in n for n in p.scenario.notes)


def test_a_model_whose_gathered_copy_does_not_fit_is_refused_in_the_rollout_phase() -> None:
    """Sharded over 64 ranks an 8B model's training step is small, but the rollout
    gathers the whole model on every rank (16 GB in bf16)."""
    cfg = load(
        None,
        [
            "model.preset=llama3-8b",
            *GRPO[:3],
            "rl.num_generations=8",
            "rl.max_prompt_length=256",
            "rl.max_completion_length=256",
            "train.global_batch_size=512",
            "train.micro_batch_size=1",
            "activations.mode=full",
        ],
    )
    p = plan(cfg, world_size=64, device=parse_device("h100:20GiB"), trace=False)
    assert p.grpo is not None and p.grpo.peak_phase == "rollout"
    assert p.memory.peak.phase == "rollout" and p.fits is False
    assert p.grpo.training.bytes < p.usable_bytes < p.memory.peak.bytes  # type: ignore[operator]
    text = format_plan(p)
    assert "DOES NOT FIT" in text and "in the rollout phase: the gathered model" in text
    assert "GRPO: the rollout phase peaks" in text
    data = json.loads(json.dumps(plan_dict(p), default=str))
    assert data["grpo"]["peak_phase"] == "rollout" and data["fits"] is False
    r = p.grpo.rollout
    assert r is not None and data["grpo"]["rollout"]["gathered"] == r.gathered
    assert data["memory"]["peak"]["breakdown"]["unsharded_params"] == r.gathered


def test_a_model_without_a_llama_shape_counts_the_gathered_model_and_says_so(
    tmp_path: Path,
) -> None:
    """GPT-2 is planned by tracing; its rollout's cache is not read, but the gathered
    model (every unit, exact for any model) is, as a lower bound, with a note."""
    write_tiny_model(tmp_path, arch="gpt2", weights=False, dim=64, layers=2, heads=4)
    cfg = load(None, [f"model.hf={tmp_path}", *GRPO])
    p = plan(cfg, world_size=2)
    assert p.grpo is not None and p.grpo.why_not is not None
    r = p.grpo.rollout
    assert r.kv_cache == 0 and r.where == "all-gather of every unit"
    assert r.gathered == 4 * sum(u.gathered for u in p.scenario.all_units)
    assert "only the gathered model is counted" in format_plan(p)


def test_other_objectives_have_no_grpo_section() -> None:
    cfg = load(None, [*SHAPE, "precision.mode=fp32"])
    p = plan(cfg, world_size=2, vocab_size=512, trace=False)
    assert p.grpo is None and "rollout" not in p.memory.phase_peaks
    data = plan_dict(p)
    assert "grpo" not in data and "grpo" not in data["scenario"]
    assert "GRPO" not in format_plan(p)


def test_the_rule_is_a_pure_function_of_numbers() -> None:
    """What the engine or the trainer would call to ask "does the gathered model fit":
    the same function the plan calls, from plain numbers."""
    p = _plan()
    sc, r = p.scenario, p.grpo.rollout  # type: ignore[union-attr]
    assert r is not None and sc.model is not None
    again = scenario_rollout(sc)
    assert again is not None and again.peak == r.peak
    shape = model_rollout(sc.model, rows=4, prompt_len=64, completion_len=64, e=4)
    resident = {k: v for k, v in r.breakdown.items() if k in ("sharded_params", "optimizer_states")}
    resident["buffers_inputs"] = sc.layout.buffer_bytes
    alone = rollout_memory(
        shape,
        resident=resident,
        gathered=r.gathered,
        largest_unit=4 * max(u.gathered for u in sc.all_units),
    )
    assert alone.peak == r.peak and alone.where == r.where


def _vllm(device: str, *extra: str) -> Plan:
    cfg = load(None, [*SHAPE, "model.n_kv_heads=2", *GRPO, "rl.engine=vllm", *extra])
    return plan(cfg, world_size=2, vocab_size=512, trace=False, device=parse_device(device))


def test_vllm_counts_the_engine_by_the_rule_the_engine_sizes_itself_with() -> None:
    """[Note: vLLM rollout memory]: the engine's whole model and its KV cache (the same
    kv_cache_bytes fsdpkit.rollout.vllm.start sizes it with), no gathered policy."""
    from fsdpkit.planner.replay.vllmmem import kv_cache_bytes

    p = _vllm("h100")
    r, terms = p.grpo.rollout, p.scenario.grpo  # type: ignore[union-attr]
    assert r is not None and terms is not None and r.gathered == 0
    want = kv_cache_bytes(layers=4, kv_heads=2, head_dim=32, itemsize=p.scenario.param_bytes,
                          sequences=terms.decode_batches * terms.rows, tokens=128)  # fmt: skip
    assert r.kv_cache == want
    weights = p.scenario.param_bytes * sum(u.gathered for u in p.scenario.all_units)
    assert r.breakdown["vllm_engine"] in (weights, weights + want)
    assert "lower bound" in " ".join(p.memory.notes)
    sized = _vllm("h100", "rl.vllm_kv_cache_mb=64").grpo.rollout  # type: ignore[union-attr]
    assert sized is not None and sized.kv_cache == 64 << 20


def test_vllm_without_sleep_keeps_the_engine_through_training() -> None:
    """A GPU engine sleeps while the trainer steps; on CPU (no sleep mode) or with sleep
    off it stays, and the training phase carries it."""
    awake = _vllm("h100", "rl.vllm_enable_sleep_mode=false")
    asleep = _vllm("h100")
    r = asleep.grpo.rollout  # type: ignore[union-attr]
    assert r is not None
    engine = r.kv_cache + asleep.scenario.param_bytes * sum(
        u.gathered for u in asleep.scenario.all_units
    )
    gap = awake.memory.phase_peaks["backward"] - asleep.memory.phase_peaks["backward"]
    assert gap == engine
    assert _vllm("cpu").memory.peak.breakdown.get("vllm_engine", 0) > 0
