"""The run configuration: typed, documented, validated, frozen data (no environment reads,
no planner calls: ``parallel.auto`` is decided above, in fsdpkit.run.resolve).

Modules, each owning one job:
    schema    the frozen section dataclasses, one docstring per field
    finetune  the [lora] and [dpo] sections (schema assembles them)
    rl        the [rl] section (online RL, train.objective = grpo) and its own checks
    rl_rules  [rl] against the other sections; the run's length under grpo
    coerce    type-checking values against the annotations (did-you-mean errors)
    validate  ranges, impossible combinations, what the world size allows
    io        TOML files, dotted overrides, ``with_changes``, ``to_toml``
    toml      the one TOML writer
    docs      ``--help-config`` text
    batch_split ``batch_split``: a step's sequences over ranks and micro-batches
    dims      ``parallel_dims``: the ranks as pp x replicate x shard x cp x tp
    schedules torch's pipelining schedules: stages per rank, micro-batches they need
"""

from fsdpkit.config.batch_split import BatchSplit, batch_split
from fsdpkit.config.coerce import suggest
from fsdpkit.config.dims import ParallelDims, parallel_dims
from fsdpkit.config.docs import describe, field_docs
from fsdpkit.config.io import (
    apply_dotted,
    from_dict,
    load,
    parse_override,
    read_toml,
    to_toml,
    with_changes,
)
from fsdpkit.config.rl import RlConfig
from fsdpkit.config.schema import (
    SECTIONS,
    ActivationsConfig,
    CheckpointConfig,
    DataConfig,
    DpoConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    OffloadConfig,
    ParallelConfig,
    PrecisionConfig,
    RunConfig,
    TrainConfig,
)
from fsdpkit.config.validate import mesh_shape, validate, validate_for_world
from fsdpkit.errors import ConfigError

__all__ = [
    "SECTIONS",
    "ActivationsConfig",
    "BatchSplit",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DpoConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "OffloadConfig",
    "ParallelConfig",
    "ParallelDims",
    "PrecisionConfig",
    "RlConfig",
    "RunConfig",
    "TrainConfig",
    "apply_dotted",
    "batch_split",
    "describe",
    "field_docs",
    "from_dict",
    "load",
    "mesh_shape",
    "parallel_dims",
    "parse_override",
    "read_toml",
    "suggest",
    "to_toml",
    "validate",
    "validate_for_world",
    "with_changes",
]
