"""The planner on fine-tuning runs: frozen parameters, LoRA adapters (on the built-in
Llama and on a model.hf directory), a bf16 base.

Shapes only (the model is prepared on meta as the trainer prepares it); the measured
accuracy is in tests/distributed/test_planner_accuracy.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tiny_hf import write_tiny_model

from fsdpkit.config import load
from fsdpkit.planner import PlanError, parse_device, plan
from fsdpkit.planner.formatting import format_plan
from fsdpkit.planner.search.recommend import recommend

pytest.importorskip("peft")

BASE = ["model.preset=llama3-8b", "data.seq_len=4096", "train.micro_batch_size=1"]
BASE += ["model.vocab_size=128256", "activations.mode=full"]


def _plan(*overrides: str, precision: str = "bf16") -> object:
    return plan(load(None, [*BASE, f"precision.mode={precision}", *overrides]), world_size=8)


def test_lora_states_are_the_adapters_only_and_the_base_is_bf16() -> None:
    full, lora = _plan(), _plan("lora.rank=16")
    units = list(lora.scenario.all_units)  # type: ignore[attr-defined]
    trainable = sum(u.grads_sharded for u in units)
    frozen = sum(u.sharded - u.grads_sharded for u in units)
    states = lora.memory.model_states  # type: ignore[attr-defined]
    # r=16 on the 7 linear layers of 32 blocks, r * (in + out) each: q and o 4096 -> 4096,
    # k and v 4096 -> 1024, gate/up/down 4096 <-> 14336
    per_block = 2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336)
    assert sum(u.grads_numel for u in units) == 16 * 32 * per_block
    assert states["optimizer_states"] == 8 * trainable
    assert states["gradients"] == 4 * trainable
    assert states["sharded_params"] == 4 * trainable + 2 * frozen  # bf16 base (auto)
    assert lora.memory.peak.bytes < full.memory.peak.bytes  # type: ignore[attr-defined]
    assert lora.comm.reduce_scatter < full.comm.reduce_scatter / 100  # type: ignore[attr-defined]
    assert "of the parameters train" in format_plan(lora)  # type: ignore[arg-type]


def test_fp32_base_and_frozen_blocks() -> None:
    fp32 = _plan("lora.rank=16", "lora.base_dtype=fp32")
    auto = _plan("lora.rank=16")
    gap = fp32.memory.model_states["sharded_params"] - auto.memory.model_states["sharded_params"]  # type: ignore[attr-defined]
    assert gap > 0.45 * auto.memory.model_states["sharded_params"]  # type: ignore[attr-defined]
    frozen = _plan('model.freeze=["model.embed_tokens.*","model.layers.[0-9].*"]')
    full = _plan()
    assert frozen.memory.peak.bytes < full.memory.peak.bytes  # type: ignore[attr-defined]
    assert (
        frozen.memory.model_states["optimizer_states"]
        < full.memory.model_states["optimizer_states"]
    )  # type: ignore[attr-defined]


def test_auto_recommends_for_lora_runs() -> None:
    """A 4-block LoRA run fits as it is: the recommender keeps it (~3 s)."""
    device = parse_device("h100", what="--device-mem")
    cfg = load(None, [*BASE[:-1], "model.n_layers=4", "lora.rank=16", "train.micro_batch_size=4"])
    rec = recommend(cfg, world_size=8, device=device, ranks_per_node=8)
    assert rec.best is not None and rec.best.plan.fits and rec.best.changes == {}


@pytest.mark.slow
def test_auto_recommends_a_change_for_a_lora_run_that_does_not_fit() -> None:
    """The whole 8B at micro-batch 4 does not fit an H100 as it is; the recommender
    finds the change that makes it fit (~40 s: it traces a dozen candidates)."""
    device = parse_device("h100", what="--device-mem")
    cfg = load(None, [*BASE[:-1], "lora.rank=16", "train.micro_batch_size=4"])
    rec = recommend(cfg, world_size=8, device=device, ranks_per_node=8)
    assert rec.best is not None and rec.best.plan.fits and rec.best.changes


def test_lora_on_a_model_hf_directory_trains_only_the_adapters(tmp_path: Path) -> None:
    hf = write_tiny_model(tmp_path / "llama", arch="llama", tokenizer=False)  # random weights
    run = [f"model.hf={hf}", "precision.mode=fp32", "data.seq_len=64"]
    full = plan(load(None, run), world_size=2)
    lora = plan(load(None, [*run, "lora.rank=4"]), world_size=2)
    units = list(lora.scenario.all_units)
    # r=4 on the 7 linear layers of 2 blocks, r * (in + out) each: q and o 64 -> 64,
    # k and v 64 -> 32 (2 kv heads of 16), gate/up/down 64 <-> 128
    per_block = 2 * (64 + 64) + 2 * (64 + 32) + 3 * (64 + 128)
    adapters = 4 * 2 * per_block
    assert lora.scenario.num_params == full.scenario.num_params + adapters
    assert sum(u.grads_numel for u in units) == adapters
    shard = adapters // 2  # every adapter dim splits evenly over 2 ranks: no padding
    assert sum(u.grads_sharded for u in units) == shard
    states = lora.memory.model_states
    assert (states["gradients"], states["optimizer_states"]) == (4 * shard, 8 * shard)
    assert states["sharded_params"] == full.memory.model_states["sharded_params"] + 4 * shard


def test_a_missing_model_hf_directory_is_a_plan_error_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(PlanError, match=re.escape(str(missing))):
        plan(load(None, [f"model.hf={missing}", "lora.rank=8"]), world_size=2)
