"""The rollout phase of a GRPO step: one rank's memory while the embedded engine
decodes its prompts. Pure functions over plain numbers, so that a plan and anything
that must ask "does the gathered model fit" (the trainer, the engine) read one rule.

[Note: rollout memory]
The embedded engine ([Note: the embedded engine] in fsdpkit.rollout.embedded)
all-gathers every FSDP unit once, keeps the whole policy gathered through every
forward of the rollout and reshards at the end; it decodes one prompt's
``rl.num_generations`` completions as one batch ([Note: decoding with a KV cache] in
fsdpkit.rollout.decoding), prompt after prompt. So on each rank, beside what stays
all step (the sharded parameters, the optimizer states (gradients are None: the last
update's ``zero_grad(set_to_none=True)``), the buffers, a reference's shards), the
rollout holds:

- the whole model's parameters in the compute dtype (``gathered``); while they are
  all-gathered, every unit's flat all-gather output is allocated at once and each is
  freed after its unit's copy-out, so the gather itself peaks at gathered + the
  largest unit;
- the KV cache of one decode batch: G rows x positions x n_layers x 2 (k, v) x
  kv_heads x head_dim x e bytes, positions growing from the prompt's P to P + C (the
  last sampled token is fed once more before the loop ends);
- the prefill's logits over every prompt position, G x P x V x e: the model returns
  logits for the whole prompt and the engine keeps a view of the last position's,
  which holds the whole tensor until the first decode step's logits replace it;
- per token the draw (fsdpkit.rollout.sampling.draw): the fp32 scaled logits of the
  live rows and the fp64 buffers of the Gumbel draw, G x V x ``draw_bytes``;
- transients: the prefill's block forward over G x P tokens, no-grad (the event model
  of fsdpkit.planner.replay.blockmem with nothing saved, plus the block's input); in
  each decode step ``torch.cat`` makes a layer's cache one position longer while the
  old one lives (one layer's k); without SDPA's own grouped-query attention the
  cached k and v are repeated to every query head (2 x heads / kv_heads x that), and
  attention's fp32 scores of the new token (G x heads x positions) join them.

The rollout's peak is the largest of these moments: the gather, a prefill block, the
prefill's logits, the first draw, the first decode step, the last draw (the cache one
position short of full), the last decode step.
Completions that stop early keep their rows in the batch (the engine feeds every
row), so the plan is the all-rows-to-the-limit case. Measured against c10's
process-wide count on 2 gloo ranks (tests/distributed/test_plan_grpo_accuracy.py):
within 0.06% with the peak at the last decode step, a prefill block and the first
draw, fp32 and bf16, built-in and transformers models.
On gloo each all-gather also allocates a temporary of its output's size on the
backend's thread, freed when the main thread drops the work: how many are alive at
the gather's peak depends on thread timing, so ``spread`` reports up to two of the
largest (the plan's typical figure leaves them out, as [Note: late frees] does).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any

from fsdpkit.models.llama import LlamaConfig
from fsdpkit.planner.replay.blockmem import Sizes, block_forward
from fsdpkit.planner.replay.ledger import summarize
from fsdpkit.planner.replay.sizing import sizes
from fsdpkit.planner.replay.vllmmem import VllmRollout, vllm_rollout
from fsdpkit.planner.shapes.result import ROLLOUT, MemoryPlan, PeakPoint
from fsdpkit.planner.shapes.scenario import Scenario
from fsdpkit.planner.shapes.states import model_states

KV, ROLLOUT_LOGITS = "kv_cache", "rollout_logits"
"""The rollout's own breakdown keys (fsdpkit.planner.shapes.result.ROLLOUT_CATEGORIES)."""


@dataclass(frozen=True)
class RolloutShape:
    """What the rollout's memory depends on, as plain numbers."""

    rows: int
    """Rows of a decode batch: one prompt's G completions."""
    prompt_len: int
    completion_len: int
    layers: int
    dim: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    e: int
    """Bytes per element of the compute dtype (the gathered parameters, the cache)."""
    draw_bytes: int = 36
    """Bytes per (row, vocabulary) element of one token's draw
    (fsdpkit.planner.model.grpo_terms.GrpoTerms.draw_bytes)."""
    gqa: bool = False
    """Attention takes k / v at their own heads (transformers' SDPA path): no repeat."""
    norm_casts_first: bool = False
    """transformers' RMSNorm (see fsdpkit.planner.replay.blocksizes.Sizes)."""

    def layer_kv(self, positions: int) -> int:
        """One layer's k (or v) for ``positions`` positions of every row."""
        return self.rows * self.kv_heads * positions * self.head_dim * self.e

    def kv_cache(self, positions: int) -> int:
        """The whole cache: k and v of every layer."""
        return 2 * self.layers * self.layer_kv(positions)

    def block(self) -> Sizes:
        """The prefill's block sizes: G x P tokens."""
        return Sizes(
            n=self.rows * self.prompt_len,
            d=self.dim,
            f=self.ffn,
            heads=self.heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            vocab=self.vocab,
            e=self.e,
            gqa=self.gqa,
            norm_casts_first=self.norm_casts_first,
        )


def model_rollout(
    m: LlamaConfig, *, rows: int, prompt_len: int, completion_len: int, e: int, **more: Any
) -> RolloutShape:
    """The shape of a rollout of a Llama-shaped model ``m`` (``more``: RolloutShape's
    optional fields)."""
    return RolloutShape(
        rows=rows,
        prompt_len=prompt_len,
        completion_len=completion_len,
        layers=m.n_layers,
        dim=m.dim,
        ffn=m.ffn_dim,
        heads=m.n_heads,
        kv_heads=m.n_kv_heads,
        head_dim=m.head_dim,
        vocab=m.vocab_size,
        e=e,
        **more,
    )


@dataclass(frozen=True)
class RolloutMemory:
    """One rank's rollout: its peak, where, and what made it up."""

    peak: int
    where: str
    breakdown: dict[str, int]
    """Live bytes at the peak per fsdpkit.planner.shapes.result key."""
    gathered: int
    """The whole model's parameters, all-gathered in the compute dtype."""
    kv_cache: int
    """The KV cache of one decode batch at its full length (P + C positions)."""
    logits: int
    """The prefill's logits (G x P x V)."""
    spread: int = 0
    """How much higher the gather may go on gloo (see the note)."""
    moments: dict[str, int] = field(default_factory=dict)
    """Each moment's total, by name (the peak is the largest)."""


def rollout_memory(
    shape: RolloutShape | None,
    *,
    resident: dict[str, int],
    gathered: int,
    largest_unit: int,
    gloo: bool = False,
) -> RolloutMemory:
    """The rollout's peak ([Note: rollout memory]). ``resident``: what the rank holds
    all step, by breakdown key; ``gathered``: bytes of the whole model gathered;
    ``largest_unit``: bytes of the largest unit's all-gathered copy. ``shape`` None:
    a model whose attention shape is unknown: the gather alone (a lower bound)."""
    base = {**resident, "unsharded_params": gathered}
    gather = [("all-gather of every unit", {"collective_buffers": largest_unit})]
    found = _moments(shape) if shape is not None else []
    moments = {name: extra for name, extra in gather + found}
    totals = {name: sum(base.values()) + sum(extra.values()) for name, extra in moments.items()}
    where = max(totals, key=lambda name: totals[name])
    breakdown = dict(base)
    for key, nbytes in moments[where].items():
        breakdown[key] = breakdown.get(key, 0) + nbytes
    return RolloutMemory(
        peak=totals[where],
        where=where,
        breakdown=breakdown,
        gathered=gathered,
        kv_cache=0 if shape is None else shape.kv_cache(shape.prompt_len + shape.completion_len),
        logits=0 if shape is None else shape.rows * shape.prompt_len * shape.vocab * shape.e,
        spread=2 * largest_unit if gloo else 0,
        moments=totals,
    )


def _moments(shape: RolloutShape) -> list[tuple[str, dict[str, int]]]:
    """Each decoding moment's bytes beyond the resident state and the gathered model."""
    s, p, c = shape, shape.prompt_len, shape.completion_len
    n = s.rows * p
    prefill_logits = n * s.vocab * s.e
    step_logits = s.rows * s.vocab * s.e
    scaled, draw = 4 * s.rows * s.vocab, s.draw_bytes * s.rows * s.vocab
    return [
        (
            f"prefill block forward ({s.rows} x {p} tokens)",
            {KV: s.kv_cache(p), "activations": n * s.dim * s.e, "temporaries": _block_peak(s)},
        ),
        (
            "prefill logits",
            {KV: s.kv_cache(p), "activations": n * s.dim * s.e, ROLLOUT_LOGITS: prefill_logits},
        ),
        ("first token draw", {KV: s.kv_cache(p), ROLLOUT_LOGITS: prefill_logits + draw}),
        (
            "first decode step",
            {KV: s.kv_cache(p + 1), ROLLOUT_LOGITS: prefill_logits + step_logits + scaled,
             "temporaries": _attention_step(s, p + 1)},
        ),
        (
            "last token draw",
            {KV: s.kv_cache(p + c - 1), ROLLOUT_LOGITS: step_logits + draw},
        ),
        (
            f"last decode step ({p + c} positions)",
            {KV: s.kv_cache(p + c), ROLLOUT_LOGITS: 2 * step_logits + scaled,
             "temporaries": _attention_step(s, p + c)},
        ),
    ]  # fmt: skip


@functools.cache
def _block_peak(shape: RolloutShape) -> int:
    """The highest bytes a no-grad block forward over the prefill's tokens adds to its
    input ([Note: block event model], nothing saved)."""
    return summarize(block_forward(shape.block(), keep=False)).peak


def _attention_step(shape: RolloutShape, positions: int) -> int:
    """A decode step's attention in one layer: the old cache beside the one ``torch.cat``
    makes, or attention itself: the cache repeated to every query head (k and v) unless
    SDPA groups the heads, and its fp32 scores of the one new token over every
    position, the larger."""
    rep = 1 if shape.gqa else shape.heads // shape.kv_heads
    repeated = 2 * rep * shape.layer_kv(positions) if rep > 1 else 0
    scores = 4 * shape.rows * shape.heads * positions
    return max(shape.layer_kv(positions - 1), repeated + scores)


def _shape(sc: Scenario) -> RolloutShape | None:
    """The rollout's shape of a GRPO scenario's Llama-shaped model (None: no shape)."""
    g = sc.grpo
    if g is None or sc.model is None:
        return None
    s = sizes(sc)
    extra = {"draw_bytes": g.draw_bytes, "gqa": s.gqa, "norm_casts_first": s.norm_casts_first}
    lengths = {"prompt_len": g.prompt_len, "completion_len": g.completion_len}
    return model_rollout(sc.model, rows=g.rows, e=sc.param_bytes, **lengths, **extra)


def scenario_rollout(sc: Scenario) -> RolloutMemory | None:
    """The rollout phase of a GRPO scenario (None: not GRPO). A model without a Llama
    shape (planned by tracing) gets the gather only: its cache's shape is unknown."""
    if sc.grpo is None:
        return None
    g, shape = sc.grpo, _shape(sc)
    host = sc.offload and sc.device.kind == "gpu"  # the states live on the host
    states = {} if host else {k: v for k, v in model_states(sc).items() if k != "gradients"}
    resident = {**states, "buffers_inputs": sc.layout.buffer_bytes, "reference": sc.reference_bytes}
    if g.engine == "vllm":
        return _with_engine(sc, shape, resident=resident)
    return rollout_memory(
        shape,
        resident=resident,
        gathered=sc.param_bytes * sum(u.gathered for u in sc.all_units),
        largest_unit=sc.param_bytes * max(u.gathered for u in sc.all_units),
        gloo=sc.device.kind != "gpu" and sc.dims.fsdp_shard > 1,
    )


def engine_memory(sc: Scenario, shape: RolloutShape | None) -> VllmRollout:
    """This rank's vLLM engine, sized as fsdpkit.rollout.vllm.start sizes it."""
    g = sc.grpo
    assert g is not None
    layers, kv_heads, head_dim, vocab = (
        (shape.layers, shape.kv_heads, shape.head_dim, shape.vocab) if shape else (0, 0, 0, 0)
    )
    return vllm_rollout(
        weights=sc.param_bytes * sum(u.gathered for u in sc.all_units),
        largest_tensor=sc.param_bytes * max(u.gathered for u in sc.all_units),
        bucket_mb=g.vllm_bucket_mb,
        kv_cache_mb=g.vllm_kv_cache_mb,
        sequences=g.decode_batches * g.rows,
        tokens=g.prompt_len + g.completion_len,
        vocab=vocab,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        itemsize=sc.param_bytes,
        host=sc.device.kind != "gpu",
    )


def _with_engine(
    sc: Scenario, shape: RolloutShape | None, *, resident: dict[str, int]
) -> RolloutMemory:
    """The rollout with a vLLM engine beside the rank ([Note: vLLM rollout memory])."""
    engine = engine_memory(sc, shape)
    base = sum(resident.values())
    moments = engine.moments()
    totals = {name: base + sum(extra.values()) for name, extra in moments.items()}
    where = max(totals, key=lambda name: totals[name])
    breakdown = dict(resident)
    for key, nbytes in moments[where].items():
        breakdown[key] = breakdown.get(key, 0) + nbytes
    return RolloutMemory(
        peak=totals[where],
        where=where,
        breakdown=breakdown,
        gathered=0,
        kv_cache=engine.kv_cache,
        logits=engine.logits,
        moments=totals,
    )


@dataclass(frozen=True)
class GrpoPhases:
    """A GRPO plan's two phases ([Note: the GRPO step in the plan])."""

    rollout: RolloutMemory
    training: PeakPoint
    """The training phase's peak (the step replayed or traced)."""
    why_not: str | None = None
    """Why the rollout's cache, logits and draws are not counted (a model without a
    Llama shape: the gather only); None when they are."""

    @property
    def peak_phase(self) -> str:
        """ "rollout" or "training": the phase with the higher peak."""
        if self.rollout.peak > self.training.bytes:
            return ROLLOUT
        return "training"


VLLM_NOTE = (
    "rl.engine = vllm: the engine's weights, KV cache and the push bucket are counted; "
    "vLLM's own workspace (its profiling run, CUDA graphs, the CUDA context) is not, so "
    "the rollout phase is a lower bound ([Note: vLLM rollout memory])"
)


def _awake_engine(sc: Scenario, memory: MemoryPlan) -> MemoryPlan:
    """With vLLM and no sleep mode (CPU, or rl.vllm_enable_sleep_mode off) the engine's
    weights and cache stay through the training phase: added to its peak."""
    g = sc.grpo
    if g is None or g.engine != "vllm":
        return memory
    memory = replace(memory, notes=(*memory.notes, VLLM_NOTE))
    if g.vllm_sleeps and sc.device.kind == "gpu":
        return memory
    engine = engine_memory(sc, _shape(sc))
    extra = engine.weights + engine.kv_cache
    peak = memory.peak
    breakdown = {**peak.breakdown, "vllm_engine": extra}
    peaks = {k: v + extra for k, v in memory.phase_peaks.items()}
    return replace(
        memory,
        peak=PeakPoint(peak.bytes + extra, peak.phase, peak.where, breakdown),
        phase_peaks=peaks,
    )


NO_SHAPE = (
    "GRPO rollout: only the gathered model is counted: the KV cache, prefill logits and "
    "token draws are read off a Llama shape (layers, kv heads, head dim), which this "
    "model does not have, so the rollout phase is a lower bound"
)


def with_rollout(sc: Scenario, memory: MemoryPlan) -> tuple[MemoryPlan, GrpoPhases]:
    """A GRPO scenario's memory with its rollout phase: the peak is the larger phase's,
    ``phase_peaks`` gains "rollout" (first)."""
    rollout = scenario_rollout(sc)
    assert rollout is not None, "a GRPO scenario"
    memory = _awake_engine(sc, memory)
    phases = GrpoPhases(rollout, memory.peak, None if sc.model is not None else NO_SHAPE)
    if phases.why_not:
        memory = replace(memory, notes=(*memory.notes, phases.why_not))
    peaks = {ROLLOUT: rollout.peak, **memory.phase_peaks}
    if phases.peak_phase != ROLLOUT:
        return replace(memory, phase_peaks=peaks), phases
    peak = PeakPoint(rollout.peak, ROLLOUT, rollout.where, rollout.breakdown)
    return replace(memory, peak=peak, phase_peaks=peaks, spread=rollout.spread), phases
