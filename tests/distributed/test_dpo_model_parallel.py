"""DPO with tensor and context parallelism on 4 gloo ranks against the one-process
reference of tests/distributed/test_dpo.py.

The same tiny transformers Llama (4 heads, 2 key/value heads), the same string and
conversational pairs and the same plain-torch reference (an unsharded model, a frozen
deep copy as the reference, ``log_softmax`` + ``gather`` over the answer tokens,
torch's AdamW) as test_dpo.py, imported from it, not rewritten. One spawn of 4 ranks
runs ``build_session`` + ``run`` (what ``fsdpkit train`` runs) for each variant in
turn, 5 steps of 4 pairs, fp32:

- dp2 x tp2, full fine-tune: the policy and the separate reference both
  tensor-parallel (their head replicated over tp, so the logits are whole);
- dp2 x cp2, LoRA: the reference is the same model with its adapters off, each side's
  log-probs summed over the two sequence slices (an autograd all-reduce);
- dp2 x cp2, SimPO: the length normalization needs each answer's whole token count;
- tp2 x cp2, full fine-tune: both splits at once, 4 micro-batches of 1 pair per rank.

Every step's loss and rewards (chosen, rejected, accuracy, margin) must equal the
reference's within 1e-5, and every step's gradient norm within 1e-4 of it (relative;
fp32 sums in another order): AdamW's update is nearly blind to a gradient's scale, so
the losses alone would not catch a cp sum whose backward is off by a factor of cp.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_dpo
import torch
from test_dpo import GAMMA, LORA, _close, _metrics, _overrides, _reference, _rows, _train
from tiny_hf import write_tiny_model

from fsdpkit.testing import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
pytest.importorskip("transformers")
pytest.importorskip("peft")

STEPS = 5
SIMPO = ["dpo.loss=simpo", f"dpo.simpo_gamma={GAMMA}"]

# name -> (reference kind, overrides); the kinds: full (a separate reference), lora, simpo
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "dp2xtp2-full": ("full", ["parallel.tp=2"]),
    "dp2xcp2-lora": ("lora", ["parallel.cp=2", *LORA]),
    "dp2xcp2-simpo": ("simpo", ["parallel.cp=2", *SIMPO]),
    "tp2xcp2-full": ("full", ["parallel.tp=2", "parallel.cp=2"]),
}
KIND_EXTRA = {"full": [], "lora": LORA, "simpo": SIMPO}


def _record_grad_norms(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The list the one-process reference's AdamW appends each step's global gradient
    norm to (the norm fsdpkit logs as grad_norm, before clipping; none is set here)."""
    norms: list[float] = []

    class Recording(torch.optim.AdamW):
        def step(self, closure: object = None) -> object:
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            norms.append(float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))))
            return super().step(closure)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.optim, "AdamW", Recording)
    return norms


def test_dpo_with_tp_and_cp_matches_one_process_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = write_tiny_model(tmp_path / "model", chat=True, vocab_size=320)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    runs = [
        _overrides(model_dir, data, tmp_path / name, *extra, f"train.steps={STEPS}")
        for name, (_, extra) in VARIANTS.items()
    ]
    sharded = run_ranks(_train, world_size=4, args=(runs,), timeout_s=400)
    assert sharded == [[True, None, None, True]] * 4  # LoRA and SimPO build no second model

    monkeypatch.setattr(test_dpo, "STEPS", STEPS)  # the reference's step count
    norms = _record_grad_norms(monkeypatch)
    want, want_norms = {}, {}
    for kind, extra in KIND_EXTRA.items():
        overrides = _overrides(model_dir, data, tmp_path / f"ref-{kind}", *extra)
        want[kind] = _reference(model_dir, overrides, lora=kind == "lora", simpo=kind == "simpo")
        want_norms[kind] = norms[-STEPS:]
    for name, (kind, _) in VARIANTS.items():
        got = _metrics(tmp_path / name)
        _close(got, want[kind], what=name)
        assert [r["grad_norm"] for r in got] == pytest.approx(want_norms[kind], rel=1e-4), name
    assert want["full"][-1]["rewards/margin"] > want["full"][0]["rewards/margin"]  # it trains
