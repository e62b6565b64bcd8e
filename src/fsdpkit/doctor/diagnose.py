"""Model checks for a run config: build the model as the run would (on the meta
device, so any size is cheap), look at the units ``shard`` would make, replay buffer
materialization, and ask the planner for the fit verdict and a one-step dry run under
fake tensors at the configured world size.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from fsdpkit.config import RunConfig
from fsdpkit.doctor.buffer_check import check_meta_buffers
from fsdpkit.doctor.check import Check, fail, ok, skip
from fsdpkit.doctor.expert_check import expert_checks
from fsdpkit.doctor.model import plan_units, structure_checks
from fsdpkit.errors import UserError
from fsdpkit.models.factory import build_model
from fsdpkit.models.hf.directory import tokenizer_vocab_size
from fsdpkit.planner import PlanError, plan
from fsdpkit.planner.formatting import fmt_bytes
from fsdpkit.sharding import choose_blocks
from fsdpkit.sharding.materialize import is_meta

REFERENCE_LIMIT_BYTES = 2 * 1024**3
"""Largest model the buffer check also builds on the CPU as a reference."""


def _vocab(cfg: RunConfig) -> int:
    """The vocabulary the run's model embeds (as fsdpkit.models.factory.llama_shape)."""
    return cfg.model.vocab_size or tokenizer_vocab_size(cfg)


def _build(cfg: RunConfig, *, vocab: int, meta: bool) -> nn.Module:

    model_cfg = dataclasses.replace(cfg.model, meta_init=meta)
    kwargs: dict[str, Any] = {
        "vocab_size": vocab,
        "seq_len": cfg.data.seq_len,
        "seed": cfg.train.seed,
    }
    if not meta or cfg.model.hf:  # model.hf always builds on meta itself, buffers real
        return build_model(model_cfg, **kwargs).module
    with torch.device("meta"):
        return build_model(model_cfg, **kwargs).module


def checkpoint_bytes(model: nn.Module) -> int:
    """Bytes one checkpoint of ``model`` takes: parameters, AdamW's two states per
    trainable parameter (same dtype), persistent buffers; tied parameters once."""
    total = 0
    for p in model.parameters():  # deduplicated by identity
        total += p.numel() * p.element_size() * (3 if p.requires_grad else 1)
    non_persistent = {
        id(m._buffers[k]) for m in model.modules() for k in m._non_persistent_buffers_set
    }
    total += sum(
        b.numel() * b.element_size() for b in model.buffers() if id(b) not in non_persistent
    )
    return total


def _buffer_check(cfg: RunConfig, *, vocab: int, param_bytes: int) -> Check:
    """As the run builds it: presets honour model.meta_init; a factory builds on meta
    only if it does so itself (then the plain call returns a meta model)."""

    meta_model = None
    if cfg.model.factory or cfg.model.hf:
        plain = _build(cfg, vocab=vocab, meta=False)
        as_run_meta = is_meta(plain)
        reference = None if as_run_meta else plain
        meta_model = plain if as_run_meta else None  # built on meta as the run builds it
    else:
        as_run_meta = cfg.model.meta_init
        small = param_bytes <= REFERENCE_LIMIT_BYTES
        reference = _build(cfg, vocab=vocab, meta=False) if small else None
    return check_meta_buffers(
        meta_model or _build(cfg, vocab=vocab, meta=True),
        reference=reference,
        as_run_meta=as_run_meta,
        loads_persistent=bool(cfg.model.init_from),
    )


def _safe_buffer_check(cfg: RunConfig, *, vocab: int, param_bytes: int) -> Check:
    try:
        return _buffer_check(cfg, vocab=vocab, param_bytes=param_bytes)
    except Exception as exc:
        return fail(
            "meta buffers",
            f"building the model for the buffer check failed: {type(exc).__name__}: {exc}",
        )


def _plan_checks(
    cfg: RunConfig, *, world_size: int, device: Any, trace: bool, vocab: int
) -> list[Check]:

    try:
        analytic = plan(cfg, world_size=world_size, device=device, vocab_size=vocab)
    except PlanError as exc:
        return [
            skip("plan fit", f"the planner cannot plan this model: {exc}"),
            skip("dry run", "not run: the planner cannot trace this model (see plan fit)"),
        ]
    except UserError as exc:  # the config does not work at this world size
        return [fail("plan fit", str(exc)), skip("dry run", "no plan to run")]
    peak = fmt_bytes(analytic.memory.peak.bytes)
    if analytic.fits is None:
        fit = skip("plan fit", f"peak {peak} per rank; device memory unknown", "pass --device-mem")
    elif analytic.fits:
        fit = ok(
            "plan fit", f"peak {peak} per rank fits in {fmt_bytes(analytic.usable_bytes)} usable"
        )
    else:
        fit = fail(
            "plan fit",
            f"peak {peak} per rank does not fit in {fmt_bytes(analytic.usable_bytes)} usable "
            f"at world size {world_size}",
            f"fsdpkit plan CONFIG --world-size {world_size} --recommend (or parallel.auto=true)",
        )
    if not trace:
        return [fit, skip("dry run", "skipped (--no-trace)")]
    return [fit, _dry_run(cfg, world_size=world_size, device=device, vocab=vocab)]


def _dry_run(cfg: RunConfig, *, world_size: int, device: Any, vocab: int) -> Check:

    try:
        traced = plan(cfg, world_size=world_size, device=device, trace=True, vocab_size=vocab)
    except PlanError as exc:
        return skip("dry run", f"not traceable: {exc}")
    except Exception as exc:
        return fail(
            "dry run",
            f"one training step at world size {world_size} under fake tensors failed: "
            f"{type(exc).__name__}: {exc}",
            "run `fsdpkit plan CONFIG --trace` for the full traceback",
        )
    mem = traced.memory
    return ok(
        "dry run",
        f"one step (forward, backward, optimizer) ran at world size {world_size} on fake "
        f"tensors in {traced.elapsed_s:.1f} s: traced peak {fmt_bytes(mem.peak.bytes)} per "
        f"rank in {mem.peak.phase}",
    )


def model_checks(
    cfg: RunConfig, *, world_size: int, device: Any = None, trace: bool = True
) -> tuple[list[Check], int | None]:
    """(model checks, bytes per checkpoint or None when the model could not be built)."""

    try:
        vocab = _vocab(cfg)
        model = _build(cfg, vocab=vocab, meta=True)
        choice = choose_blocks(model, class_names=cfg.parallel.block_classes or None)
    except UserError as exc:
        return [fail("model build", str(exc), "fix the [model] / [data] section")], None
    except Exception as exc:
        return [
            fail("model build", f"building the model failed: {type(exc).__name__}: {exc}")
        ], None
    units = plan_units(choice.blocks, cfg)
    size = checkpoint_bytes(model)
    n_params = sum(p.numel() for p in model.parameters())
    checks = [
        ok(
            "model build",
            f"{type(model).__name__}: {n_params / 1e6:.2f}M parameters, {len(units)} block "
            f"unit(s); blocks: {choice.describe()}",
        ),
        *structure_checks(
            model,
            units,
            block_classes=cfg.parallel.block_classes,
            edge_units=cfg.parallel.edge_units,
        ),
        *expert_checks(model, units, cfg),
        _safe_buffer_check(cfg, vocab=vocab, param_bytes=size // 3),
        *_plan_checks(cfg, world_size=world_size, device=device, trace=trace, vocab=vocab),
    ]
    return checks, size
