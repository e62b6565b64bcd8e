"""``build_trainable``: the model, loss and optimizer a run trains, built one way for
the trainer, the traced planner and the planner's measurement.

[Note: one builder]
The order FSDP2 requires, written once:

1. ``build_unsharded`` (no process group; bad input fails every rank alike before any
   collective): the model (built-in Llama, ``model.hf`` on meta, or the factory's),
   LoRA / ``model.freeze`` (fsdpkit.finetune.prepare_model), the loss (``train.chunked_loss``
   over the model's own loss: fsdpkit.loss.head.choose_loss) and the block choice.
2. ``shard_trainable`` (a real or a "fake" process group's mesh): parameters turned into
   fake tensors when the planner traces, buffers to the device, ``fsdpkit.shard`` (which
   materializes a meta model with the run's initializer), ``model.init_from`` weights,
   then the optimizer over the trainable parameters.

``fsdpkit train`` runs both steps on real ranks; the traced planner runs step 1 outside
``FakeTensorMode`` and step 2 inside it at any world size; ``fsdpkit.planner.traced.measure``
runs both on real CPU ranks. A change to how a run is built is made here, so the plan
cannot drift from the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from fsdpkit.checkpoint.fsdp1 import detect, load_fsdp1_checkpoint
from fsdpkit.checkpoint.hf_weights import load_hf_weights
from fsdpkit.config import RunConfig
from fsdpkit.finetune import Finetune, base_view, prepare
from fsdpkit.loss.contract import LossFn
from fsdpkit.loss.head import choose_loss, default_loss
from fsdpkit.loss.router import RouterLoss, RouterSpec, describe, with_router_loss
from fsdpkit.models.buffers import require_buffer_source
from fsdpkit.models.factory import BuiltModel, build_model
from fsdpkit.models.hf.construct import HFWeights, construct
from fsdpkit.models.llama import LlamaConfig
from fsdpkit.models.presets import builtin_model
from fsdpkit.precision import Precision
from fsdpkit.pretrained import is_hf_model
from fsdpkit.sharding import ShardPlan, detect_blocks, resolve_precision, shard
from fsdpkit.sharding.context.batch import context_parallel_loss
from fsdpkit.sharding.experts.parallel import check_model as check_experts
from fsdpkit.sharding.heads import heads_cp
from fsdpkit.sharding.materialize import is_meta
from fsdpkit.sharding.mesh import cp_mesh
from fsdpkit.sharding.tensor.rules import check_model
from fsdpkit.trainable.optim import build_optimizer

if TYPE_CHECKING:  # typing only: torch's pipelining is imported only under parallel.pp
    from fsdpkit.sharding.pipeline.stages import Pipeline


@dataclass
class Unsharded:
    """Step 1 of [Note: one builder]: the prepared model before sharding."""

    built: BuiltModel
    finetune: Finetune
    precision: Precision
    loss_fn: LossFn
    loss_note: str | None
    """Why ``train.chunked_loss = auto`` kept full logits (None: it did not)."""


@dataclass
class Trainable:
    """The sharded model, its loss and optimizer, and what building them decided."""

    model: nn.Module
    loss_fn: LossFn
    optimizer: torch.optim.Optimizer
    plan: ShardPlan
    precision: Precision
    finetune: Finetune
    llama: LlamaConfig | None
    """The built-in model's shape (None for model.hf and factory models)."""
    loss_note: str | None = None
    """What the run's first lines say about the loss: where a model.hf model's weights
    came from, the chunked-loss choice, the router loss (None: nothing to say)."""
    pipeline: Pipeline | None = None
    """Under parallel.pp: this rank's stages and their schedule; ``model`` is then the
    rank's view of its parameters ([Note: stage modules]). None without pp."""


def build_unsharded(
    cfg: RunConfig,
    *,
    vocab_size: int,
    device_type: str,
    sft: bool = False,
    shape: LlamaConfig | None = None,
) -> Unsharded:
    """Step 1 of [Note: one builder]. ``shape``: build the built-in Llama of exactly this
    shape on meta (the planner's scenario), instead of the one ``cfg.model`` names."""
    built = _built(cfg, vocab_size=vocab_size, shape=shape)
    precision = resolve_precision(cfg.precision, device_type=device_type)
    finetune = prepare(built.module, cfg, precision=precision, init=built.init)
    loss = choose_loss(
        built.module,
        mode=cfg.train.chunked_loss,
        chunk_tokens=cfg.train.loss_chunk_tokens,
        default=default_loss(sft=sft, own=built.loss_fn),
        custom_loss=built.loss_fn is not None,
        compiled=cfg.train.compile and precision.low_precision,  # where it helps
    )
    blocks = detect_blocks(built.module, class_names=cfg.parallel.block_classes or None)
    if cfg.parallel.tp > 1 or cfg.parallel.cp > 1:
        check_model(
            built.module,
            tp=cfg.parallel.tp,
            cp=heads_cp(cp=cfg.parallel.cp, attention=cfg.parallel.cp_attention),
            blocks=blocks,
        )
    if cfg.parallel.ep > 1 or cfg.model.capacity_factor is not None:
        check_experts(built.module, ep=cfg.parallel.ep, capacity=cfg.model.capacity_factor)
    return Unsharded(built, finetune, precision, loss.loss_fn, loss.note)


def _built(cfg: RunConfig, *, vocab_size: int, shape: LlamaConfig | None) -> BuiltModel:
    if shape is None or cfg.model.hf or cfg.model.factory:
        return build_model(
            cfg.model, vocab_size=vocab_size, seq_len=cfg.data.seq_len, seed=cfg.train.seed
        )
    with torch.device("meta"):
        return BuiltModel(module=builtin_model(shape), loss_fn=None, llama=shape)


def shard_trainable(
    unsharded: Unsharded,
    cfg: RunConfig,
    *,
    mesh: Any,
    device: torch.device,
    fake: FakeTensorMode | None = None,
) -> Trainable:
    """Step 2 of [Note: one builder], collective over ``mesh``. With ``fake`` (the
    traced planner, inside that mode) the parameters become fake tensors first and no
    weights are read."""
    model = unsharded.built.module
    if fake is not None:
        fake_tensors(model, fake=fake)
    else:
        place(model, device=device)
    if cfg.parallel.pp > 1:
        return _pipelined(unsharded, cfg, mesh=mesh, device=device)
    plan = shard(model, cfg, mesh=mesh, init=unsharded.finetune.init)
    if cfg.model.init_from and fake is None:
        init_from(model, Path(cfg.model.init_from))
    optimizer = build_optimizer(model, cfg.train, grad_scaler=unsharded.precision.scaler)
    cp = cp_mesh(mesh)
    ring = cfg.parallel.cp_attention == "ring"
    loss_fn = (
        unsharded.loss_fn
        if cp is None
        else context_parallel_loss(unsharded.loss_fn, mesh=cp, ring=ring)
    )
    loss_fn = with_router_loss(
        loss_fn, model=model, coef=cfg.model.router_aux_loss_coef, tp=cfg.parallel.tp
    )
    return Trainable(
        model=model,
        loss_fn=loss_fn,
        optimizer=optimizer,
        plan=plan,
        precision=unsharded.precision,
        finetune=unsharded.finetune,
        llama=unsharded.built.llama,
        loss_note=_notes(unsharded, loss_fn, capacity=cfg.model.capacity_factor),
    )


def place(model: nn.Module, *, device: torch.device) -> None:
    """Before sharding: a meta-built model must have a source for its buffers (never
    train on buffers that ``to_empty`` leaves as garbage); a real one gets its buffers
    on ``device`` (fully_shard moves the parameters' shards)."""
    if is_meta(model):
        require_buffer_source(model)
    else:
        model.to(device)


def _pipelined(
    unsharded: Unsharded, cfg: RunConfig, *, mesh: Any, device: torch.device
) -> Trainable:
    """Step 2 under ``parallel.pp``: this rank's stages (fsdpkit.trainable.pipeline.build)."""
    from fsdpkit.trainable.pipeline.build import build_pipeline

    built = build_pipeline(unsharded, cfg, mesh=mesh, device=device)
    if cfg.model.init_from:  # each rank reads its stages' weights, by the model's names
        init_from(built.view, Path(cfg.model.init_from))
    return Trainable(
        model=built.view,
        loss_fn=built.loss_fn,
        optimizer=build_optimizer(built.view, cfg.train, grad_scaler=unsharded.precision.scaler),
        plan=built.pipeline.plans[0],
        precision=unsharded.precision,
        finetune=unsharded.finetune,
        llama=unsharded.built.llama,
        loss_note=_notes(
            unsharded, built.loss_fn, capacity=cfg.model.capacity_factor, stages=built.router
        ),
        pipeline=built.pipeline,
    )


def _notes(
    unsharded: Unsharded,
    loss_fn: LossFn,
    *,
    capacity: float | None,
    stages: RouterSpec | None = None,
) -> str | None:
    """For the run's first lines: where a model.hf model's weights came from, the
    chunked-loss choice, the router loss (``stages``: carried across pipeline stages)."""
    init = unsharded.built.init
    weights = init.describe() if isinstance(init, HFWeights) else None
    spec = loss_fn.spec if isinstance(loss_fn, RouterLoss) else stages
    router = describe(spec, capacity=capacity) if spec is not None else None
    if stages is not None:
        router = f"{router}; carried across the pipeline stages with the hidden states"
    return "\n".join(n for n in (weights, unsharded.loss_note, router) if n) or None


def init_from(model: nn.Module, path: Path) -> None:
    """``model.init_from``: HF safetensors or an FSDP1 checkpoint, read into the base
    model's names ([Note: LoRA with FSDP2])."""
    with base_view(model):
        if detect(path):
            load_fsdp1_checkpoint(model, path)
        else:  # an HF model's weights in transformers' layout ([Note: one loading rule ...])
            shadow = construct(model.config) if is_hf_model(model) else None  # type: ignore[arg-type]
            load_hf_weights(model, path, shadow=shadow)


def fake_tensors(model: nn.Module, *, fake: FakeTensorMode) -> None:
    """Give a model built outside fake mode fake CPU parameters and buffers (tied
    parameters stay tied; real buffers keep their values' metadata). Runs inside
    ``fake``: ``torch.empty`` there makes a tensor without storage."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for key, p in module._parameters.items():
            if p is not None and not isinstance(p, FakeTensor):
                if id(p) not in made:
                    data = torch.empty(p.shape, dtype=p.dtype)  # fake: no storage
                    made[id(p)] = nn.Parameter(data, requires_grad=p.requires_grad)
                module._parameters[key] = made[id(p)]  # type: ignore[assignment]
        for key, b in module._buffers.items():
            if b is not None and not isinstance(b, FakeTensor):
                module._buffers[key] = (
                    torch.empty(b.shape, dtype=b.dtype) if b.is_meta else fake.from_tensor(b)
                )
