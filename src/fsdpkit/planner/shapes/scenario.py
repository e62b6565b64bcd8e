"""One resolved training setup: the numbers the planner computes over.

``scenario()`` turns a RunConfig (the same one ``fsdpkit train`` reads), a world size
and a device into a frozen ``Scenario``: model shape, the FSDP units ``shard()`` would
build (fsdpkit.planner.model.unit_layout), mesh, dtypes and batch. Everything that is the user's
to fix raises ``PlanError`` naming the field, before any arithmetic runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from fsdpkit import precision as presets
from fsdpkit.config import (
    ParallelDims,
    RunConfig,
    batch_split,
    parallel_dims,
    validate,
    validate_for_world,
)
from fsdpkit.config.rl_rules import with_rl_context
from fsdpkit.data import is_dataset
from fsdpkit.devices import Device
from fsdpkit.models.experts import Experts
from fsdpkit.models.hf.directory import tokenizer_vocab_size, with_model_tokenizer
from fsdpkit.models.llama import LlamaConfig
from fsdpkit.models.presets import PRESETS
from fsdpkit.planner.errors import PlanError
from fsdpkit.planner.experts.parallel import ep_units
from fsdpkit.planner.experts.routed import moe_notes
from fsdpkit.planner.experts.routing import BALANCED, Routing
from fsdpkit.planner.model.builtin import model_shape, planned_builtin, selective_why_traced
from fsdpkit.planner.model.dpo_reference import reference_terms
from fsdpkit.planner.model.grpo_terms import GrpoTerms, grpo_terms
from fsdpkit.planner.model.unit_layout import ModelLayout, Unit
from fsdpkit.planner.shapes.mparallel import check_layout, tp_layout, vocab_parallel
from fsdpkit.sharding.policy import SyncMode, reshard_after_forward, sync_mode
from fsdpkit.sharding.tensor.rules import check_layout as trainer_layout_check
from fsdpkit.trainable.optim import resolve_impl

__all__ = ["Scenario", "model_shape", "scenario"]  # model_shape: fsdpkit.planner.model.builtin

_UNCOUNTED_EXCHANGES = (
    "the tp / cp activation exchanges are not in the traffic figures: their formulas "
    "read a Llama shape, which this model does not have (its memory is traced)"
)
_VOCAB_NOTE = (
    "model.vocab_size: planned with the preset's {} (train takes the tokenizer's: set "
    "data.tokenizer or model.vocab_size)"
)


@dataclass(frozen=True)
class Scenario:
    """Everything the memory and communication models need, resolved."""

    model: LlamaConfig | None
    """The Llama shape the analytic model plans (None: a model it cannot replay, which
    is planned by tracing; see ``analytic_why_not``)."""
    dims: ParallelDims
    """The run's degrees ([Note: parallel dimensions] in fsdpkit.config.dims): its
    ``world``, ``replicate`` (1 for full / grad_op), ``shard`` (the mesh axis),
    ``fsdp_shard`` (the ranks one parameter is sharded over: shard x cp), ``dp``, ``tp``,
    ``cp``, ``pp`` and ``ep`` (borrowed from ``shard``). ``fsdpkit plan --json`` shows
    them as the scenario's keys world_size, replicate, shard (= fsdp_shard), tp, cp, pp
    and ep (fsdpkit.planner.shapes.scenario_json)."""
    strategy: str
    precision: str
    """Resolved preset: fp32, bf16, bf16-pure or fp16."""
    reshard_after_forward: bool | int
    """The strategy's resharding (per unit: ``Unit.reshard_after_forward``)."""
    layout: ModelLayout
    root: Unit
    units: tuple[Unit, ...]
    """Block units in forward order, as ``shard()`` builds them."""
    ac_mode: str
    ac_every: int
    offload: bool
    micro_batch: int
    seq_len: int
    grad_accum: int
    keep_unsharded: bool
    device: Device
    ranks_per_node: int
    loss_chunk: int | None = None
    """Tokens per chunk of the chunked cross-entropy; None: full logits
    (``train.chunked_loss``, resolved by ``loss_chunk``)."""
    notes: tuple[str, ...] = ()
    """How inputs were interpreted (e.g. precision auto -> bf16)."""
    vocab_size: int = 0
    """Rows of the model's input embedding (token ids a traced step may draw)."""
    flops_per_token: float = 0.0
    """Training FLOPs per token (the recommender's step-time estimate)."""
    analytic_why_not: str | None = None
    """Why the analytic model cannot plan this run (None: it can)."""
    source: str = ""
    """A model.hf / model.factory model, as reports name it ("" for the built-in Llama)."""
    async_checkpoint: bool = False
    """checkpoint.async_save: staging buffers on the host for the whole run."""
    accum_sync: SyncMode = "last"
    """Resolved parallel.accum_sync: "last" or "every" ([Note: accumulation modes])."""
    accum_auto: bool = False
    """parallel.accum_sync = auto, not decided yet (fsdpkit.planner.api decides it by
    the memory budget)."""
    optimizer_impl: str = "foreach"
    """Resolved train.optimizer_impl: for-loop, foreach or fused ([Note: AdamW kernels])."""
    forward_prefetch: int = 0
    backward_prefetch: int = 1
    cp_attention: str = "ulysses"
    """parallel.cp_attention: "ulysses" (heads for sequence) or "ring" (k / v rotate;
    [Note: ring attention memory] in fsdpkit.planner.replay.ringmem)."""
    sequence_parallel: bool = False
    """Whether the residual stream and norms are split over tp too (the built-in Llama
    with tp > 1; [Note: model-parallel block memory] in fsdpkit.planner.shapes.mparallel)."""
    vocab_parallel: bool = False
    """Whether the embedding and head are split by vocabulary over tp (loss parallel:
    fsdpkit.planner.shapes.mparallel.vocab_parallel)."""
    edges: tuple[Unit, ...] = ()
    """An untied embedding, the final norm and the head as units of their own, in
    forward order, named by role ([Note: edge units] in fsdpkit.sharding.edges)."""
    reference_bytes: int = 0
    """DPO's frozen reference model: its sharded parameters per rank ([Note: reference
    in the plan] in fsdpkit.planner.model.dpo_reference; 0: none)."""
    reference_forward: int = 0
    """What the reference's no-grad forward holds at its peak besides them."""
    experts: Experts | None = None
    """A mixture-of-experts model's routing and parameter census (None: dense)."""
    expert_units: tuple[Unit, ...] = ()
    """Under ep, each block's routed experts as a unit of their own over shard / ep
    ranks ([Note: expert units] in fsdpkit.planner.experts.parallel)."""
    routing: Routing = BALANCED
    """Under ep, the routing the trace assumes ([Note: routing in the plan] in
    fsdpkit.planner.experts.routing; default: balanced)."""
    grpo: GrpoTerms | None = None
    """``train.objective = grpo``: its rollout and the shape of its step ([Note: the
    GRPO step in the plan] in fsdpkit.planner.model.grpo_terms); None otherwise."""

    def edge(self, role: str) -> Unit | None:
        """The edge unit of ``role`` ("embedding", "norm", "head"), None if it is in the
        root."""
        return next((u for u in self.edges if u.name == role), None)

    @property
    def forward_units(self) -> tuple[Unit, ...]:
        """The non-root units in forward order: embedding, blocks, final norm, head."""
        first = [u for u in self.edges if u.name == "embedding"]
        return (*first, *self.units, *[u for u in self.edges if u.name != "embedding"])

    @property
    def all_units(self) -> tuple[Unit, ...]:
        """Every unit: the root, the edge units, the block units, the experts units."""
        return (self.root, *self.edges, *self.units, *self.expert_units)

    @property
    def every_sync(self) -> bool:
        """Reduce-scatter on every micro-batch (only meaningful with accumulation)."""
        return self.accum_sync == "every" and self.grad_accum > 1

    @property
    def param_bytes(self) -> int:
        return presets.PRESETS[self.precision].param_bytes

    @property
    def reduce_bytes(self) -> int:
        return presets.PRESETS[self.precision].reduce_bytes

    @property
    def checkpointed_blocks(self) -> int:
        return sum(sum(u.checkpointed) for u in self.units)

    @property
    def num_params(self) -> int:
        """Parameters of the model (tied ones once), from its layout."""
        edges = [s for e in self.layout.edges for s in e.shapes]
        shapes = [*self.layout.root, *edges, *(s for b in self.layout.blocks for s in b)]
        return sum(rows * cols for rows, cols in shapes)

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch of one data-parallel rank (the whole sequences, before
        cp splits them)."""
        return self.micro_batch * self.seq_len

    def with_(self, **changes: object) -> Scenario:
        return replace(self, **changes)  # type: ignore[arg-type]


def planned_precision(mode: str, device: Device | None) -> tuple[str, str | None]:
    """The preset the run will use on ``device``, and a note when ``auto`` was read."""
    gpu = device is not None and device.kind == "gpu"
    bf16 = gpu and device is not None and device.bf16
    name = presets.preset_name(mode, bf16_device=bf16)
    if mode != presets.AUTO:
        return name, None
    why = (
        "a bf16-capable GPU was given"
        if bf16
        else "no GPU device was given"
        if not gpu or device is None
        else device.name
    )
    return name, f"precision.mode = auto planned as {name} ({why})"


def run_vocab_size(cfg: RunConfig) -> int | None:
    """The vocabulary ``fsdpkit train`` takes when model.vocab_size is empty: the
    tokenizer's (None: no tokenizer is configured, the preset's own is planned)."""
    data = with_model_tokenizer(cfg).data  # model.hf: the directory's tokenizer
    prepared = data.path is not None and is_dataset(Path(data.path).expanduser())
    if cfg.model.vocab_size is not None or (data.tokenizer is None and not prepared):
        return None  # a prepared dataset brings its own tokenizer
    return tokenizer_vocab_size(cfg)


def loss_chunk(
    cfg: RunConfig, layout: ModelLayout, *, why_not: str | None = None
) -> tuple[int | None, str | None]:
    """The chunk of the run's chunked loss (None: full logits), and a note when
    ``auto`` falls back — the rule of fsdpkit.loss.head.choose_loss: the
    built-in Llama's head is plain unless LoRA wraps it; for a model.hf / factory
    model ``why_not`` is that function's reason (None: supported)."""
    mode = cfg.train.chunked_loss
    if mode == "off":
        return None, None
    if why_not is not None:
        if mode == "on":
            raise PlanError(f"train.chunked_loss = on, but {why_not}. Set it to auto or off.")
        return None, f"train.chunked_loss = auto planned as full logits ({why_not})"
    if layout.plain_head:
        return cfg.train.loss_chunk_tokens, None
    if mode == "on":
        raise PlanError(
            "train.chunked_loss = on, but the output head is LoRA-wrapped (not a plain "
            "nn.Linear). Set train.chunked_loss = auto or off."
        )
    return None, "train.chunked_loss = auto planned as full logits (the head is LoRA-wrapped)"


def scenario(
    cfg: RunConfig,
    *,
    world_size: int,
    device: Device | None = None,
    ranks_per_node: int = 8,
    vocab_size: int | None = None,
    routing: Routing = BALANCED,
) -> Scenario:
    """Resolve ``cfg`` at ``world_size`` ranks on ``device`` (None: unknown memory, CPU
    semantics); ``vocab_size`` is the tokenizer's (default: read as ``fsdpkit train``
    reads it, see ``run_vocab_size``); ``routing``: a MoE model's under ep. Raises
    PlanError / ConfigError naming the field on bad input."""
    cfg = with_rl_context(cfg)  # GRPO: the model's context holds prompt + completion
    local = _checked_sizes(cfg, world_size=world_size, ranks_per_node=ranks_per_node)
    dims = parallel_dims(cfg, world_size=world_size, local_world_size=local)
    vocab = vocab_size if vocab_size is not None else run_vocab_size(cfg)
    precision, note = planned_precision(cfg.precision.mode, device)
    model = planned_builtin(cfg, vocab=vocab, precision=precision)
    why_not = model.why_traced or selective_why_traced(cfg)
    check_layout(model.shape, tp=dims.tp, cp=dims.cp, attention=cfg.parallel.cp_attention)
    if model.shape is None:  # traced: the launcher's own check of the model's plan and heads
        trainer_layout_check(cfg)
    split_vocab = vocab_parallel(model.layout, vocab=model.vocab_size, tp=dims.tp)
    local_layout = tp_layout(
        model.layout, tp=dims.tp, vocab=model.vocab_size if split_vocab else None
    )
    planned, experts = ep_units(
        local_layout,
        shard=dims.fsdp_shard,
        ep=dims.ep,
        parallel=cfg.parallel,
        activations=cfg.activations,
    )
    chunk, loss_note = loss_chunk(cfg, model.layout, why_not=model.chunked_why_not)
    notes = [n for n in (note, loss_note, _vocab_note(cfg, vocab=vocab)) if n]
    if model.shape is None and (dims.tp > 1 or dims.cp > 1):
        notes.append(_UNCOUNTED_EXCHANGES)
    dev = device if device is not None else Device("unspecified", "cpu", None)
    split = batch_split(cfg.train, dp_world=dims.dp)
    builtin = not (cfg.model.hf or cfg.model.factory)
    all_units = (planned.root, *planned.edges, *planned.blocks)
    grpo = grpo_terms(cfg, split=split, dp=dims.dp)  # [Note: the GRPO step in the plan]
    dpo = reference_terms(  # [Note: reference in the plan]
        cfg,
        units=all_units,
        rows=(1 if grpo else 2) * split.micro_batch,
        seq_len=cfg.data.seq_len,
        vocab=model.vocab_size,
        low=presets.PRESETS[precision].param_bytes == 2,
        grpo=grpo,
        buffers=model.layout.buffer_bytes,
    )
    if dpo.rows_per_pair == 2 or grpo is not None:  # their log-probs take full logits
        chunk = None
        notes += [dpo.note] if dpo.note else []
    if routing != BALANCED and (model.experts is None or dims.ep == 1):
        raise PlanError(
            "--moe-imbalance plans how unevenly a mixture-of-experts model's router fills "
            "the expert-parallel ranks, but this run has no parallel.ep > 1 (or no routed "
            "experts): without ep a rank's grouped GEMMs hold its tokens x top_k rows "
            "whatever the routing. Set parallel.ep, or drop --moe-imbalance."
        )
    notes += moe_notes(
        model.experts,
        model.router,
        dp=dims.dp,
        tokens=split.micro_batch * cfg.data.seq_len,
        cp=dims.cp,
        ep=dims.ep,
        tp=dims.tp,
        pp=dims.pp,
        routing=routing,
    )
    return Scenario(
        model=model.shape,
        dims=dims,
        strategy=cfg.parallel.strategy,
        precision=precision,
        reshard_after_forward=reshard_after_forward(cfg.parallel),
        layout=model.layout,
        root=planned.root,
        units=planned.blocks,
        edges=planned.edges,
        ac_mode=cfg.activations.mode,
        ac_every=cfg.activations.every,
        offload=cfg.offload.params,
        micro_batch=dpo.rows_per_pair * split.micro_batch,
        seq_len=cfg.data.seq_len if grpo is None else grpo.seq_len,
        grad_accum=split.grad_accum,
        keep_unsharded=cfg.parallel.accum_keep_unsharded,
        device=dev,
        ranks_per_node=local,
        loss_chunk=chunk,
        notes=tuple(notes),
        vocab_size=model.vocab_size,
        flops_per_token=model.flops_per_token,
        analytic_why_not=why_not,
        source=model.what,
        async_checkpoint=cfg.checkpoint.async_save and cfg.checkpoint.every > 0,
        accum_sync=sync_mode(cfg.parallel.accum_sync),
        accum_auto=cfg.parallel.accum_sync == "auto",
        optimizer_impl=planned_optimizer(cfg, dev, precision=precision),
        forward_prefetch=cfg.parallel.forward_prefetch,
        backward_prefetch=cfg.parallel.backward_prefetch,
        cp_attention=cfg.parallel.cp_attention,
        sequence_parallel=dims.tp > 1 and (builtin or model.layout.sequence_parallel),
        vocab_parallel=split_vocab,
        reference_bytes=dpo.resident,
        reference_forward=dpo.forward,
        experts=model.experts,
        expert_units=experts,
        routing=routing,
        grpo=grpo,
    )


def _checked_sizes(cfg: RunConfig, *, world_size: int, ranks_per_node: int) -> int:
    """Ranks per node of the plan, after checking the sizes and the config."""
    if world_size < 1:
        raise PlanError(f"--world-size must be >= 1, got {world_size}.")
    if ranks_per_node < 1:
        raise PlanError(f"--ranks-per-node must be >= 1, got {ranks_per_node}.")
    validate(cfg)
    local = min(ranks_per_node, world_size)
    validate_for_world(cfg, world_size=world_size, local_world_size=local)
    return local


def _vocab_note(cfg: RunConfig, *, vocab: int | None) -> str | None:
    """Why a built-in preset is planned at its own vocabulary (no tokenizer given)."""
    builtin = not (cfg.model.hf or cfg.model.factory)
    if builtin and cfg.model.vocab_size is None and vocab is None and cfg.model.preset != "tiny":
        return _VOCAB_NOTE.format(PRESETS[cfg.model.preset].vocab_size)
    return None


def planned_optimizer(cfg: RunConfig, device: Device, *, precision: str) -> str:
    """The AdamW kernel the run uses: the step runs where the sharded parameters live
    (the host with offload.params); fp16's gradient scaler rules out fused."""
    on_cpu = device.kind == "cpu" or cfg.offload.params
    scaler = cfg.precision.grad_scaler
    scaler = presets.PRESETS[precision].scaler if scaler is None else scaler
    return resolve_impl(
        cfg.train.optimizer_impl, device_type="cpu" if on_cpu else "cuda", grad_scaler=scaler
    )
