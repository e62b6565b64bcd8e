"""One resolved training setup: the numbers the planner computes over.

``scenario()`` turns a RunConfig (the same one ``fsdpkit train`` reads), a world size
and a device into a frozen ``Scenario``: model shape, mesh, dtypes, resharding,
checkpointing and batch. Everything that is the user's to fix raises ``PlanError``
naming the field, before any arithmetic runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fsdpkit.config import RunConfig, mesh_shape, validate, validate_for_world
from fsdpkit.errors import UserError
from fsdpkit.models.factory import llama_config
from fsdpkit.models.llama import PRESETS, LlamaConfig
from fsdpkit.planner.devices import Device

# (param dtype bytes, reduce dtype bytes) of each precision preset (fsdpkit.sharding.policy).
PRECISION_BYTES = {"fp32": (4, 4), "bf16": (2, 4), "bf16-pure": (2, 2), "fp16": (2, 4)}


_VOCAB_NOTE = (
    "model.vocab_size: planned with the preset's {} (train takes the tokenizer's: set "
    "data.tokenizer or model.vocab_size)"
)


class PlanError(UserError, ValueError):
    """The planner cannot plan this input; the message names the field."""


@dataclass(frozen=True)
class Scenario:
    """Everything the memory and communication models need, resolved."""

    model: LlamaConfig
    world_size: int
    replicate: int
    """Replicas (HSDP outer axis); 1 for full / grad_op."""
    shard: int
    """Ranks one parameter is sharded over (the shard axis)."""
    strategy: str
    precision: str
    """Resolved preset: fp32, bf16, bf16-pure or fp16."""
    reshard_after_forward: bool | int
    blocks_per_unit: int
    ac_mode: str
    ac_every: int
    offload: bool
    micro_batch: int
    seq_len: int
    grad_accum: int
    keep_unsharded: bool
    device: Device
    ranks_per_node: int
    notes: tuple[str, ...] = ()
    """How inputs were interpreted (e.g. precision auto -> bf16)."""

    @property
    def param_bytes(self) -> int:
        return PRECISION_BYTES[self.precision][0]

    @property
    def reduce_bytes(self) -> int:
        return PRECISION_BYTES[self.precision][1]

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch per rank."""
        return self.micro_batch * self.seq_len

    def with_(self, **changes: object) -> Scenario:
        return replace(self, **changes)  # type: ignore[arg-type]


def model_config(cfg: RunConfig, *, vocab_size: int | None = None) -> LlamaConfig:
    """The Llama shape ``fsdpkit train`` builds for ``cfg`` (fsdpkit.models.factory).

    Train takes the vocabulary from model.vocab_size, else from the tokenizer; pass the
    tokenizer's size as ``vocab_size``. Without either, the preset's vocabulary is
    planned (a note says so), which is what a real run of a preset needs anyway.
    """
    m = cfg.model
    if m.factory is not None:
        raise PlanError(
            f"model.factory = {m.factory!r}: the planner knows the built-in Llama presets "
            "only. Plan with model.preset set to the closest preset (and model.dim/n_layers "
            "overrides), or measure your model with `fsdpkit train` on one step."
        )
    if m.preset not in PRESETS:
        raise PlanError(
            f"model.preset = {m.preset!r} is not a built-in preset; choose one of "
            f"{', '.join(PRESETS)}."
        )
    vocab = vocab_size or PRESETS[m.preset].vocab_size
    try:
        return llama_config(m, vocab_size=vocab, seq_len=cfg.data.seq_len)
    except UserError as exc:
        raise PlanError(str(exc)) from None


def resolve_precision(mode: str, device: Device | None) -> tuple[str, str | None]:
    """The preset the run will use, and a note when ``auto`` was interpreted."""
    if mode != "auto":
        return mode, None
    if device is not None and device.kind == "gpu" and device.bf16:
        return "bf16", "precision.mode = auto planned as bf16 (a bf16-capable GPU was given)"
    where = "no GPU device was given" if device is None or device.kind != "gpu" else device.name
    return "fp32", f"precision.mode = auto planned as fp32 ({where})"


def _reshard(cfg: RunConfig) -> bool | int:
    p = cfg.parallel
    if p.reshard_after_forward is not None:
        return p.reshard_after_forward
    return p.strategy in ("full", "hybrid")


def scenario(
    cfg: RunConfig,
    *,
    world_size: int,
    device: Device | None = None,
    ranks_per_node: int = 8,
    vocab_size: int | None = None,
) -> Scenario:
    """Resolve ``cfg`` at ``world_size`` ranks on ``device`` (None: unknown memory, CPU
    semantics); ``vocab_size`` is the tokenizer's (see ``model_config``). Raises
    PlanError / ConfigError naming the field on bad input."""
    if world_size < 1:
        raise PlanError(f"--world-size must be >= 1, got {world_size}.")
    if ranks_per_node < 1:
        raise PlanError(f"--ranks-per-node must be >= 1, got {ranks_per_node}.")
    validate(cfg)
    local = min(ranks_per_node, world_size)
    validate_for_world(cfg, world_size=world_size, local_world_size=local)
    replicate, shard = mesh_shape(cfg, world_size=world_size, local_world_size=local)
    shape = model_config(cfg, vocab_size=vocab_size)
    precision, note = resolve_precision(cfg.precision.mode, device)
    notes = [note] if note else []
    if cfg.model.vocab_size is None and vocab_size is None and cfg.model.preset != "tiny":
        notes.append(_VOCAB_NOTE.format(PRESETS[cfg.model.preset].vocab_size))
    dev = device if device is not None else Device("unspecified", "cpu", None)
    return Scenario(
        model=shape,
        world_size=world_size,
        replicate=replicate,
        shard=shard,
        strategy=cfg.parallel.strategy,
        precision=precision,
        reshard_after_forward=_reshard(cfg),
        blocks_per_unit=cfg.parallel.blocks_per_unit,
        ac_mode=cfg.activations.mode,
        ac_every=cfg.activations.every,
        offload=cfg.offload.params,
        micro_batch=cfg.train.micro_batch_size,
        seq_len=cfg.data.seq_len,
        grad_accum=cfg.train.grad_accum,
        keep_unsharded=cfg.parallel.accum_keep_unsharded,
        device=dev,
        ranks_per_node=local,
        notes=tuple(notes),
    )
