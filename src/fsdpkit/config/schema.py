"""The shape of a run's configuration: frozen, documented dataclasses (data only).

A run is described by a TOML file whose sections are the dataclasses below, plus
dotted ``key=value`` overrides (``train.steps=50``). Every field has a docstring under
it; ``fsdpkit train --help-config`` prints them. Configs are frozen: change one with
``fsdpkit.config.with_changes`` (validated), never by assignment.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from fsdpkit.config.finetune import DpoConfig, LoraConfig
from fsdpkit.config.parallel import ParallelConfig
from fsdpkit.config.rl import RlConfig

# The choices of a few fields. Precision names must equal the keys of
# fsdpkit.precision.PRESETS (a unit test checks; strategies: fsdpkit.config.parallel).
PrecisionMode = Literal["auto", "fp32", "bf16", "bf16-pure", "fp16"]
ACMode = Literal["none", "full", "every", "selective"]
Schedule = Literal["cosine", "constant", "linear"]
OptimizerImpl = Literal["auto", "for-loop", "foreach", "fused"]


@dataclass(frozen=True)
class ModelConfig:
    preset: str = "tiny"
    """Built-in Llama-style shape: tiny, llama3-1b, llama3-3b, llama3-8b, llama3-70b or
    llama3-405b; or mixture of experts (Qwen3-MoE's layout): moe-tiny, qwen3-30b-a3b,
    qwen3-235b-a22b. See docs/models.md."""
    factory: str | None = None
    """Your own model instead of a preset: "package.module:function" returning an nn.Module
    (or (module, loss_fn)); called with no arguments. The module maps token ids (batch, seq)
    to logits (batch, seq, vocab), or to an HF ModelOutput / dict / tuple holding them;
    loss_fn(module, tokens) gets the (batch, seq + 1) ids. Build under fsdpkit.meta_params()
    to avoid a full copy per rank. See docs/models.md."""
    hf: str | None = None
    """A local Hugging Face model directory (config.json, optional *.safetensors and
    tokenizer.json) instead of a preset: always built on meta, each rank reads its own slices
    of the weights; a bare config.json trains from the model's own random init; its
    tokenizer.json is the default data.tokenizer. Never downloads."""
    init_missing: bool = False
    """model.hf: let weights the directory lacks get the model's own random init (stated in
    the run's first lines) instead of refusing the directory. Off: a directory that holds
    some weights must hold all of them (after transformers' own renames and fusions)."""
    router_aux_loss_coef: float | None = None
    """Mixture-of-experts models: the weight of the router's load-balancing loss added to
    the objective; empty = the preset's or config.json's router_aux_loss_coef, 0 = off.
    See docs/models.md."""
    capacity_factor: float | None = None
    """Mixture-of-experts models: each rank keeps at most capacity_factor x tokens x top_k
    / experts of a layer's assignments per expert (first come, first served) and drops
    the rest (counted in the metrics: moe_dropped); empty = no capacity, no token dropped."""
    n_layers: int | None = None
    """Override the preset's number of blocks."""
    dim: int | None = None
    """Override the preset's hidden size."""
    n_heads: int | None = None
    """Override the preset's query heads."""
    n_kv_heads: int | None = None
    """Override the preset's key/value heads."""
    ffn_dim: int | None = None
    """Override the preset's SwiGLU hidden size."""
    experts: int | None = None
    """Override an MoE preset's routed experts per block."""
    top_k: int | None = None
    """Override an MoE preset's experts per token."""
    vocab_size: int | None = None
    """Override the vocabulary size (default: the tokenizer's)."""
    tie_embeddings: bool | None = None
    """Override whether the output head shares the embedding."""
    meta_init: bool = True
    """Build on the meta device and materialize only local shards (no rank holds the full model)."""
    init_from: str | None = None
    """Directory of HF-layout safetensors to initialize the weights from."""
    freeze: list[str] = field(default_factory=list)
    """Parameter-name globs to freeze (no gradients, no optimizer state), e.g.
    ["model.embed_tokens.*", "model.layers.[0-7].*"]; a bare name matches as a suffix
    ("embed_tokens.weight"). Each pattern must match something. See docs/finetune.md."""


@dataclass(frozen=True)
class DataConfig:
    path: str | None = None
    """What to train on: a directory written by `fsdpkit data prepare` (it has a
    manifest.json), or raw sources, prepared once into data.cache_dir: a text file,
    directory or glob, .jsonl (.jsonl.gz/.jsonl.zst), .json (array of records),
    .parquet, an Arrow directory from datasets.save_to_disk, or a local Hugging Face
    dataset repository (its train split). Empty = the built-in corpus (Python's
    standard-library sources). See docs/data.md."""
    mix: list[str] = field(default_factory=list)
    """Several sources sampled by weight instead of data.path: ["PATH@WEIGHT", ...]
    (weight 1 when left out), each PATH as data.path, e.g. ["wiki/@3", "code.jsonl@1"];
    a fixed interleave of the sources by weight, each one reshuffled on its own epochs;
    shares are printed at the start and resumed exactly."""
    text_field: str = "text"
    """Field holding the text in records (jsonl/json/parquet/Arrow) of plain-text data."""
    tokenizer: str | None = None
    """Directory (or file) with a Hugging Face tokenizer.json; empty = byte-level (vocab
    256), or the tokenizer a prepared data.path was made with."""
    seq_len: int = 128
    """Tokens per training sequence (packed, fixed length)."""
    val_fraction: float = 0.02
    """Share held out for validation: the last documents (text) or examples (SFT) of the
    data; with fewer documents than 1 / val_fraction, the last tokens instead."""
    max_bytes: int | None = None
    """Read at most this many bytes of the sources (a file crossing the limit is cut at
    a line); the run's first lines say how much was left out. Empty = all of them."""
    allow_binary: bool = False
    """Train on files that look binary (NUL bytes or mostly invalid UTF-8); by default
    such a file is refused by name."""
    format: Literal["auto", "text", "sft"] = "auto"
    """text: next-token prediction on every token; sft: loss on the answers only (SFT
    schemas, see data.schema); auto: sft when the first record matches an SFT schema,
    text for text files and records with data.text_field; records that match neither
    are refused."""
    schema: Literal["auto", "messages", "sharegpt", "prompt_completion", "alpaca", "text"] = "auto"
    """Record schema: messages (role/content chat), sharegpt (conversations of from/value),
    prompt_completion (TRL: strings or message lists), alpaca (instruction/input/output),
    text (data.text_field); auto = detected per record and printed. Forcing one refuses
    records of any other."""
    columns: list[str] = field(default_factory=list)
    """Rename columns before the schema is detected: ["KEY=COLUMN", ...] with KEY a
    schema's name, e.g. ["prompt=question", "completion=answer"]."""
    pack: bool = True
    """SFT: pack several examples into one sequence, each attending only to itself
    (position ids restart per example: block-diagonal causal attention); false = one
    example per sequence, padded."""
    workers: int = 0
    """Processes that tokenize when sources are prepared (files and row ranges in
    parallel); 0 = one per CPU core."""
    cache_dir: str | None = None
    """Where raw data.path / data.mix sources are prepared (once; reused while sources,
    tokenizer and options are unchanged); empty = RUN_DIR/data."""


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    """Optimizer steps to run."""
    seed: int = 0
    """Seed for weights, data order and dropout-free determinism."""
    global_batch_size: int | None = None
    """Sequences per optimizer step over all ranks; micro-batches and accumulation are
    derived per world size, so a resume at another world size keeps the training math
    (see fsdpkit.config.batch_split). Empty = micro_batch_size x grad_accum per rank."""
    micro_batch_size: int = 4
    """Sequences per rank per micro-batch; with global_batch_size set, the largest
    micro-batch a rank may take (memory)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (only the last one reduces gradients); only
    when global_batch_size is empty (otherwise it is derived)."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final LR as a fraction of the peak (cosine/linear)."""
    warmup_steps: int = 20
    """Linear warm-up steps."""
    schedule: Schedule = "cosine"
    """LR schedule after warm-up: cosine, linear or constant."""
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to norms and biases)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables."""
    eval_every: int = 100
    """Evaluate on the validation split every N steps (and at the end); 0 disables."""
    eval_batches: int = 4
    """Micro-batches per rank in one evaluation."""
    sample_tokens: int = 120
    """Tokens of sample text generated at the end for the built-in LM; 0 disables."""
    compile: bool = False
    """torch.compile each block (after activation checkpointing, before sharding), and in
    bf16/fp16 runs each chunk of the chunked loss; the first step includes compilation,
    reported apart as compile_s and kept out of tokens/s. On a CPU inductor needs a C++
    compiler, and small models gain little."""
    optimizer_impl: OptimizerImpl = "auto"
    """torch AdamW kernel: for-loop (one parameter at a time, least temporary memory),
    foreach (multi-tensor: fast, one temporary the size of all 2-D weights), fused (one
    kernel, no temporaries; CPU and CUDA); auto = fused wherever parameters live on the
    CPU (offload.params, CPU ranks: measured fastest there, see docs/levers.md) and on
    CUDA, else foreach; foreach under fp16's gradient scaler (fused cannot step with it)."""
    chunked_loss: Literal["auto", "on", "off"] = "auto"
    """Cross-entropy from the final hidden states and the output head in token chunks
    (fsdpkit.loss.chunked_ce): no full logits, no fp32 copy of them, no full logits
    gradient; each chunk's logits are recomputed in backward (one more head matmul).
    auto = on wherever the head is a plain nn.Linear and the loss is fsdpkit's own
    (built-in Llama, model.hf causal LMs, factory models exposing
    get_output_embeddings() or lm_head): it never holds more than full logits, so it
    always lowers the peak where the loss made it; otherwise off with one notice.
    on = an error where unsupported. off = full logits."""
    loss_chunk_tokens: int = 1024
    """Tokens per chunk of the chunked loss: logits of this many tokens (and their fp32
    copy) exist at once."""
    objective: Literal["lm", "dpo", "grpo"] = "lm"
    """What the run optimizes: lm = next-token cross-entropy (text or SFT rows); dpo =
    preference tuning on chosen/rejected pairs with the [dpo] section's loss
    (docs/preference.md), train.micro_batch_size counting pairs; grpo = online RL on
    prompt rows: completions sampled by the policy, scored by the [rl] section's
    rewards, the clipped policy-gradient loss (docs/rl.md)."""


@dataclass(frozen=True)
class PrecisionConfig:
    mode: PrecisionMode = "auto"
    """fp32, bf16 (bf16 compute, fp32 reduce), bf16-pure, fp16 (+ grad scaler);
    auto = bf16 on GPUs that support it, else fp32."""
    norms_fp32: bool = False
    """Keep norm layers' parameters and compute in fp32 (own FSDP units)."""
    grad_scaler: bool | None = None
    """Dynamic loss scaling; empty = on for fp16, off otherwise. fp16 requires it."""


@dataclass(frozen=True)
class OffloadConfig:
    params: bool = False
    """Keep sharded parameters, gradients and the optimizer step on the CPU."""


@dataclass(frozen=True)
class ActivationsConfig:
    mode: ACMode = "none"
    """Activation checkpointing: none, full (every block recomputed), every (every k-th
    block), or selective (every block, op-level: the outputs of every other matmul and
    of attention are saved, norms, RoPE and activations recomputed; memory between
    none and full, recompute cheaper than full)."""
    every: int = 2
    """With mode = every: checkpoint one block in this many."""


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0
    """Save every N steps (and at the end when > 0); 0 disables periodic saves."""
    keep: int = 2
    """Keep the newest K complete checkpoints."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this; 0 disables."""
    async_save: bool = False
    """Write checkpoints in the background while training continues."""
    resume: str = "auto"
    """auto (newest complete checkpoint in the run dir), never, or a checkpoint path."""
    save_on_sigterm: bool = True
    """On SIGTERM (preemption), SIGINT (Ctrl-C) or SIGHUP checkpoint the current step
    before exiting; false stops at the step boundary without saving."""
    adapters_only: bool = False
    """Save only the trainable parameters (LoRA adapters, lora.trainable, what model.freeze
    leaves) and their optimizer state; on resume the frozen base comes from model.hf /
    init_from / the seed, checked against a fingerprint saved with the adapters."""


@dataclass(frozen=True)
class LoggingConfig:
    run_dir: str = "runs/default"
    """Directory for the resolved config, metrics.jsonl, checkpoints and plots."""
    log_every: int = 1
    """Write metrics every N steps."""
    progress: Literal["auto", "bar", "lines", "none"] = "auto"
    """Progress display on rank 0: auto = a bar on a terminal, plain lines otherwise."""
    report: bool = True
    """At the end write report.html and PNG plots into the run dir (needs matplotlib:
    pip install 'fsdpkit[report]'; without it one line says so and the run goes on)."""
    tensorboard: bool = False
    """Also write the metrics as TensorBoard event files to RUN_DIR/tensorboard (rank 0;
    needs pip install 'fsdpkit[tensorboard]')."""
    wandb: Literal["off", "offline", "online"] = "off"
    """Also log the metrics to Weights & Biases (needs wandb); offline needs no network
    (upload later with `wandb sync`)."""
    profile_steps: list[int] = field(default_factory=list)
    """[first, last]: torch profiler trace of these steps (1-based) on every rank plus a
    table of where the step time went, in RUN_DIR/profile; empty = off."""


@dataclass(frozen=True)
class RunConfig:
    """The whole run: one frozen section per TOML table."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    activations: ActivationsConfig = field(default_factory=ActivationsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    rl: RlConfig = field(default_factory=RlConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {
    f.name: typing.get_type_hints(RunConfig)[f.name] for f in dataclasses.fields(RunConfig)
}
