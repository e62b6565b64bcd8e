"""The configurations bench/plan_accuracy.py measures: model shapes and the matrix.

Each Case is one row: a name, a world size, a model (a built-in shape of ``MODELS`` or a
config-only model.hf directory of ``HF_MODELS``) and the config overrides of the row.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # tiny_hf

from tiny_hf import write_tiny_model

from fsdpkit.config import RunConfig, load
from fsdpkit.models.llama import LlamaConfig
from fsdpkit.planner.shapes.scenario import model_shape

MODELS = {
    # fp32 models (bf16 matmuls are ~86x slower on CPUs without AVX512-BF16)
    "S": ["model.vocab_size=2048", "data.seq_len=128", "train.micro_batch_size=4"],
    "M": [
        "model.dim=384", "model.n_layers=6", "model.n_heads=6", "model.n_kv_heads=2",
        "model.ffn_dim=1024", "model.vocab_size=4096", "data.seq_len=256",
        "train.micro_batch_size=2",
    ],
    # large vocabularies: embedding and head hold most parameters (issue 8)
    "V1": [
        "model.dim=128", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_dim=256", "model.vocab_size=2000", "model.tie_embeddings=false",
        "data.seq_len=96", "train.micro_batch_size=2",
    ],
    "V2": [
        "model.dim=256", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_dim=512", "model.vocab_size=32000", "model.tie_embeddings=true",
        "data.seq_len=64", "train.micro_batch_size=2",
    ],
    "V3": [
        "model.dim=192", "model.n_layers=3", "model.n_heads=6", "model.n_kv_heads=2",
        "model.ffn_dim=512", "model.vocab_size=8000", "model.tie_embeddings=false",
        "data.seq_len=128", "train.micro_batch_size=2",
    ],
    # chunked loss (issue 12): tiny but wide, 32k vocabulary, 1024-token sequences
    "W": [
        "model.dim=256", "model.vocab_size=32768", "data.seq_len=1024",
        "train.micro_batch_size=2",
    ],
    # a tiny one for bf16
    "T": [
        "model.dim=128", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_dim=344", "model.vocab_size=1024", "data.seq_len=64",
        "train.micro_batch_size=2",
    ],
}  # fmt: skip


HF_SHAPE = {"dim": 128, "layers": 3, "heads": 4, "kv_heads": 2, "ffn": 344, "vocab_size": 2048}
HF_MODELS = {
    # model.hf directories (config.json only: the model's own random init), issue 10
    "HL": "llama",
    "HM": "mistral",
    "HQ": "qwen2",
    "HG": "gpt2",
    "HGe": "gemma",
    # issue 36: mixture-of-experts families (4 experts, top 2; ffn is each expert's)
    "HX": "mixtral",
    "HQ3": "qwen3_moe",
}
HF_RUN = ["data.seq_len=128", "train.micro_batch_size=2"]


@functools.cache
def _hf_root() -> Path:
    """One temporary directory per process that writes a model directory, removed when
    it exits (importing this module writes nothing: the bench's ranks import it too)."""
    root = Path(tempfile.mkdtemp(prefix="fsdpkit-plan-accuracy-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@functools.cache
def hf_dir(arch: str) -> str:
    """A config-only model directory of ``arch`` (written once per bench run)."""
    out = _hf_root() / arch
    write_tiny_model(out, arch=arch, weights=False, tokenizer=False, **HF_SHAPE)
    return str(out)


@dataclass(frozen=True)
class Case:
    name: str
    world: int
    model: str
    overrides: tuple[str, ...]

    def config(self) -> RunConfig:
        if self.model in HF_MODELS:
            model = [f"model.hf={hf_dir(HF_MODELS[self.model])}", *HF_RUN]
        else:
            model = ["model.preset=tiny", *MODELS[self.model]]
        return load(None, [*model, "precision.mode=fp32", *self.overrides])

    def shape(self) -> LlamaConfig | None:
        """The built-in model's shape (None: a model.hf model, built by the trainer)."""
        return None if self.model in HF_MODELS else model_shape(self.config())


FULL, GRAD_OP, REPL = (
    "parallel.strategy=full",
    "parallel.strategy=grad_op",
    "parallel.strategy=replicate",
)
AC, EVERY = "activations.mode=full", "activations.mode=every"
BF16 = "precision.mode=bf16"
HYBRID = ("parallel.strategy=hybrid", "parallel.shard_degree=2")
SYNC_EVERY = "parallel.accum_sync=every"
NO_EDGES = "parallel.edge_units=false"
EVERY_KEEP = (SYNC_EVERY, "parallel.accum_keep_unsharded=true")
PREFETCH_2_2 = ("parallel.forward_prefetch=2", "parallel.backward_prefetch=2")
PREFETCH_2_3 = ("parallel.forward_prefetch=2", "parallel.backward_prefetch=3")

MODELS["A"] = [  # issue 12: activations dominate (seq 512, 4 blocks, GQA)
    "model.dim=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
    "model.ffn_dim=688", "model.vocab_size=2048", "data.seq_len=512",
    "train.micro_batch_size=2",
]  # fmt: skip
MODELS["P"] = [  # issue 38: pipeline stages (4 untied blocks, 8 micro-batches of 1)
    "model.dim=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
    "model.ffn_dim=344", "model.vocab_size=1024", "model.tie_embeddings=false",
    "data.seq_len=64", "train.micro_batch_size=1", "train.global_batch_size=8",
]  # fmt: skip
PP_LAYOUTS = (  # planned analytically per pipeline rank; the row is the highest peak
    ("1F1B pp2 x dp2", ("parallel.pp=2",)),
    ("Interleaved1F1B pp2 x dp2", ("parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B")),
    ("GPipe pp2 x dp2", ("parallel.pp=2", "parallel.pp_schedule=GPipe")),
    ("ZBVZeroBubble pp2 x dp2", ("parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble")),
    (
        "InterleavedZeroBubble pp2 x dp2",
        ("parallel.pp=2", "parallel.pp_schedule=InterleavedZeroBubble"),
    ),
    ("DualPipeV pp2 x dp2", ("parallel.pp=2", "parallel.pp_schedule=DualPipeV")),
    ("1F1B pp4", ("parallel.pp=4",)),
    ("1F1B pp2 x tp2", ("parallel.pp=2", "parallel.tp=2")),
    ("1F1B pp2 x cp2", ("parallel.pp=2", "parallel.cp=2")),
    ("1F1B pp2 x dp2 +AC", ("parallel.pp=2", "activations.mode=full")),
    ("tied 1F1B pp2 x dp2", ("model.tie_embeddings=true", "parallel.pp=2")),
    (
        "tied ZBVZeroBubble pp2 x dp2",
        ("model.tie_embeddings=true", "parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble"),
    ),
)
SEL, ACT_MODES = "activations.mode=selective", ("none", "selective", "full")
MODELS["E"] = [  # issue 37: the built-in MoE model (8 experts, top 2), traced
    "model.preset=moe-tiny", "model.dim=128", "model.n_layers=2", "model.experts=8",
    "model.vocab_size=2048", "data.seq_len=128", "train.micro_batch_size=2",
]  # fmt: skip
EP2 = "parallel.ep=2"
MP_LAYOUTS = (  # model A's 2 kv heads split over tp 2; tp 4 needs 4 (MHA)
    ("dp2 x tp2", ("parallel.tp=2",)),
    ("tp4 MHA", ("parallel.tp=4", "model.n_kv_heads=4")),
    ("dp2 x cp2", ("parallel.cp=2",)),
    ("tp2 x cp2", ("parallel.tp=2", "parallel.cp=2")),
    ("dp2 x cp2 ring", ("parallel.cp=2", "parallel.cp_attention=ring")),
)

CASES = [
    Case("S full", 1, "S", (FULL,)),
    Case("M full +AC", 1, "M", (FULL, AC)),
    Case("S full", 2, "S", (FULL,)),
    Case("S full +AC", 2, "S", (FULL, AC)),
    Case("S grad_op", 2, "S", (GRAD_OP,)),
    Case("S grad_op +AC", 2, "S", (GRAD_OP, AC)),
    Case("S replicate", 2, "S", (REPL,)),
    Case("S full accum=2", 2, "S", (FULL, "train.grad_accum=2")),
    Case("S full AC every 2", 2, "S", (FULL, EVERY)),
    Case("S full 2 blocks/unit", 2, "S", (FULL, "parallel.blocks_per_unit=2")),
    Case("S full 4 blocks/unit +AC", 2, "S", (FULL, AC, "parallel.blocks_per_unit=4")),
    Case("M full", 2, "M", (FULL,)),
    Case("M full +AC", 2, "M", (FULL, AC)),
    Case("M grad_op +AC", 2, "M", (GRAD_OP, AC)),
    Case("T bf16 full", 2, "T", (FULL, BF16)),
    Case("T bf16 full +AC", 2, "T", (FULL, BF16, AC)),
    Case("T bf16 grad_op", 2, "T", (GRAD_OP, BF16)),
    Case("S hybrid 2x2", 4, "S", HYBRID),
    Case("S full +AC", 4, "S", (FULL, AC)),
    Case("S full raf=2", 4, "S", (FULL, "parallel.reshard_after_forward=2")),
    Case("M full +AC", 4, "M", (FULL, AC)),
    Case("T bf16 hybrid +AC", 4, "T", (*HYBRID, BF16, AC)),
    # issue 8: large vocabularies, world size 3, three blocks per unit
    Case("V1 bf16 full +AC", 3, "V1", (FULL, BF16, AC)),
    Case("V1 full", 2, "V1", (FULL,)),
    Case("V1 full +AC", 3, "V1", (FULL, AC)),
    Case("V2 full", 2, "V2", (FULL,)),
    Case("V2 full +AC", 2, "V2", (FULL, AC)),
    Case("V2 grad_op", 3, "V2", (GRAD_OP,)),
    Case("V3 full", 3, "V3", (FULL,)),
    Case("V3 full AC every 2", 2, "V3", (FULL, EVERY)),
    Case("S full", 3, "S", (FULL,)),
    Case("S grad_op +AC", 3, "S", (GRAD_OP, AC)),
    Case("S full 3 blocks/unit", 2, "S", (FULL, "parallel.blocks_per_unit=3")),
    Case("S full 3 blocks/unit +AC", 3, "S", (FULL, AC, "parallel.blocks_per_unit=3")),
    Case("M full 3 blocks/unit", 2, "M", (FULL, "parallel.blocks_per_unit=3")),
    # issue 10: Hugging Face models (model.hf); analytic for the Llama family only
    Case("HL hf llama full", 2, "HL", (FULL,)),
    Case("HL hf llama full +AC", 2, "HL", (FULL, AC)),
    # transformers' RMSNorm saves its bf16 cast, not an fp32 copy ([Note: transformers'
    # Llama in the plan])
    Case("HL hf llama bf16 full", 2, "HL", (FULL, BF16)),
    Case("HL hf llama bf16 full +AC", 2, "HL", (FULL, BF16, AC)),
    Case("HM hf mistral grad_op", 2, "HM", (GRAD_OP,)),
    Case("HQ hf qwen2 full", 2, "HQ", (FULL,)),
    Case("HG hf gpt2 full", 2, "HG", (FULL,)),
    Case("HG hf gpt2 full +AC", 2, "HG", (FULL, AC)),
    Case("HGe hf gemma full", 2, "HGe", (FULL,)),
    # issue 36: MoE families, traced (experts' grouped GEMMs, the router loss's gathers)
    Case("HX hf mixtral full", 2, "HX", (FULL,)),
    Case("HX hf mixtral full +AC", 2, "HX", (FULL, AC)),
    Case("HQ3 hf qwen3_moe full", 2, "HQ3", (FULL,)),
    Case("HQ3 hf qwen3_moe full +AC", 2, "HQ3", (FULL, AC)),
    # issue 37: the built-in MoE model without and with expert parallelism (balanced
    # routing traced, [Note: expert parallelism in the plan])
    Case("E moe full", 2, "E", (FULL,)),
    Case("E moe ep2", 2, "E", (FULL, EP2)),
    Case("E moe ep2 +AC", 2, "E", (FULL, EP2, AC)),
    Case("E moe dp2 x ep2", 4, "E", (FULL, EP2)),
    Case("E moe dp2 x ep2 +AC", 4, "E", (FULL, EP2, AC)),
    Case("E hf qwen3_moe ep2", 2, "HQ3", (FULL, EP2)),
    # with a capacity factor the trace routes the capacity bound (E x C rows per rank)
    *(
        Case(
            f"E moe dp2 x ep2 capacity {cf}{label}",
            4,
            "E",
            (FULL, EP2, f"model.capacity_factor={cf}", *ac),
        )
        for cf in ("1.0", "1.25")
        for label, ac in (("", ()), (" +AC", (AC,)))
    ),
    # issue 12: op-level selective checkpointing, beside none and full on the same model
    *(Case(f"ACT A {m}", 2, "A", (FULL, f"activations.mode={m}")) for m in ACT_MODES),
    Case("ACT A selective MHA", 2, "A", (FULL, SEL, "model.n_kv_heads=4")),
    Case("ACT S selective grad_op", 2, "S", (GRAD_OP, SEL)),
    Case("ACT M selective", 3, "M", (FULL, SEL)),
    Case("ACT T bf16 selective", 2, "T", (FULL, BF16, SEL)),
    Case("ACT HL hf llama selective", 2, "HL", (FULL, SEL)),
    Case("ACT HQ hf qwen2 selective", 2, "HQ", (FULL, SEL)),
    # issue 12: accumulation modes (parallel.accum_sync) and explicit prefetch
    Case("ACC S accum=2 every", 2, "S", (FULL, "train.grad_accum=2", "parallel.accum_sync=every")),
    Case("ACC S accum=4 last", 2, "S", (FULL, "train.grad_accum=4", "parallel.accum_sync=last")),
    Case("ACC S accum=4 every", 2, "S", (FULL, "train.grad_accum=4", "parallel.accum_sync=every")),
    Case("ACC M accum=3 last", 2, "M", (FULL, "train.grad_accum=3", "parallel.accum_sync=last")),
    Case("ACC M accum=3 every", 2, "M", (FULL, "train.grad_accum=3", "parallel.accum_sync=every")),
    Case("ACC S accum=3 every keep", 2, "S", (FULL, "train.grad_accum=3", *EVERY_KEEP)),
    Case("ACC T bf16 accum=2 every", 2, "T", (FULL, BF16, "train.grad_accum=2", SYNC_EVERY)),
    Case("ACC S hybrid accum=2 every", 4, "S", (*HYBRID, "train.grad_accum=2", SYNC_EVERY)),
    # a later micro-batch's block backward sums into the accumulated grads in place
    # ([Note: accumulating in place] in fsdpkit.planner.replay.gradlife), with checkpointing
    Case("ACC A accum=2 +AC", 4, "A", (FULL, AC, "train.grad_accum=2")),
    Case("ACC A accum=2 selective", 2, "A", (FULL, SEL, "train.grad_accum=2")),
    Case("ACC S prefetch fwd2 bwd2", 2, "S", (FULL, *PREFETCH_2_2)),
    Case("ACC M prefetch fwd2 bwd3 +AC", 2, "M", (FULL, AC, *PREFETCH_2_3)),
    # the optimizer step peaks at world size 1 with AC: each AdamW kernel's temporary
    Case("ACC M opt for-loop +AC", 1, "M", (FULL, AC, "train.optimizer_impl=for-loop")),
    Case("ACC M opt foreach +AC", 1, "M", (FULL, AC, "train.optimizer_impl=foreach")),
    Case("ACC M opt fused +AC", 1, "M", (FULL, AC, "train.optimizer_impl=fused")),
    # issue 12: chunked linear cross-entropy against full logits
    Case("W full logits", 2, "W", (FULL, "train.chunked_loss=off")),
    Case("W chunked", 2, "W", (FULL, "train.chunked_loss=on")),
    Case("W chunked 256", 2, "W", (FULL, "train.chunked_loss=on", "train.loss_chunk_tokens=256")),
    Case("W full logits +AC", 2, "W", (FULL, AC, "train.chunked_loss=off")),
    Case("W chunked +AC", 2, "W", (FULL, AC, "train.chunked_loss=on")),
    Case("W chunked untied", 2, "W", (FULL, "train.chunked_loss=on", "model.tie_embeddings=false")),
    Case(
        "T bf16 chunked 48",
        2,
        "T",
        (FULL, BF16, "train.chunked_loss=on", "train.loss_chunk_tokens=48"),
    ),
    # untied embedding, norm and head in the root unit (parallel.edge_units=false); the
    # V1/V3/W untied rows above have them as units of their own (the default)
    Case("V1 bf16 full +AC root edges", 3, "V1", (FULL, BF16, AC, NO_EDGES)),
    Case("V3 full root edges", 3, "V3", (FULL, NO_EDGES)),
    Case("W chunked untied root edges", 2, "W", (FULL, "model.tie_embeddings=false", NO_EDGES)),
    Case("V1 grad_op +AC", 2, "V1", (GRAD_OP, AC)),
    Case("V3 full accum=2 every", 3, "V3", (FULL, "train.grad_accum=2", SYNC_EVERY)),
    # issue 23: tensor (+ sequence) and context (Ulysses) parallelism with FSDP2, world 4
    *(
        Case(f"MP A {name}{label}", 4, "A", (FULL, *layout, *ac))
        for name, layout in MP_LAYOUTS
        for label, ac in (("", ()), (" +AC", (AC,)))
    ),
    # selective checkpointing saves the collectives' outputs too: the sequence-parallel
    # gathers and reduce-scatters, Ulysses's all-to-alls ([Note: selective
    # checkpointing of exchanges] in fsdpkit.planner.replay.blockmem)
    *(Case(f"MP A {name} selective", 4, "A", (FULL, *layout, SEL)) for name, layout in MP_LAYOUTS),
    Case("MP A dp2 x tp2 +AC accum=2", 4, "A", (FULL, AC, "parallel.tp=2", "train.grad_accum=2")),
    # bf16: the casts of the final norm on the sequence shard and of RoPE under cp
    Case("MP T bf16 dp2 x tp2", 4, "T", (FULL, BF16, "parallel.tp=2")),
    Case("MP T bf16 tp2 x cp2 +AC", 4, "T", (FULL, BF16, AC, "parallel.tp=2", "parallel.cp=2")),
    # without checkpointing the peak sits in a block unit's reduce-scatter, beside its last
    # gradient ([Note: the last gradient] in fsdpkit.planner.replay.gradlife)
    Case("MP T bf16 tp2 x cp2", 4, "T", (FULL, BF16, "parallel.tp=2", "parallel.cp=2")),
    Case("MP T bf16 dp2 x cp2 selective", 4, "T", (FULL, BF16, SEL, "parallel.cp=2")),
    # transformers' Qwen2 (no analytic shape: traced) and Llama under tp / cp
    *(
        Case(f"MP {m} {name}{label}", 4, m.split()[0], (FULL, *layout, *ac))
        for m in ("HQ hf qwen2", "HL hf llama")
        for name, layout in MP_LAYOUTS
        if "MHA" not in name and "ring" not in name
        for label, ac in (("", ()), (" +AC", (AC,)))
    ),
    *(
        Case(f"MP HL hf llama {name} selective", 4, "HL", (FULL, *layout, SEL))
        for name, layout in MP_LAYOUTS
        if name in ("dp2 x tp2", "tp2 x cp2")
    ),
    # issue 38: pipeline parallelism ([Note: pipeline plans]), world 4
    *(Case(f"PP P {name}", 4, "P", (FULL, *layout)) for name, layout in PP_LAYOUTS),
]
QUICK = [c for c in CASES if c.world == 2 and c.name in ("S full +AC", "S grad_op", "T bf16 full")]
"""The subset tests/distributed/test_planner_accuracy.py checks."""
