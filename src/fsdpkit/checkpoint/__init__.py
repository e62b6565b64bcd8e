"""Sharded checkpoints that never lose work: atomic, async, verified, resumable at any
world size, convertible to and from Hugging Face safetensors.

Modules, each owning one thing:
    layout        directory layout, completion marker, checksums, verify
    retention     which complete checkpoints to delete (pure)
    state         Stateful adapters: model+optimizer, rank-local state, RNG streams
    checkpointer  Checkpointer: save (sync/async), retention, resume
    resume        choose the checkpoint to resume from, load it
    signals       SIGTERM flag and cross-rank agreement for preemption
    hf / export   HF config, load_hf_weights, offline export (hf | torch)
    summary       inspect / list data for the CLI

Security: DCP's ``.metadata`` and non-tensor state are pickles; load only checkpoints
you trust (see docs/checkpoints.md).
"""

from fsdpkit.checkpoint.checkpointer import Checkpointer
from fsdpkit.checkpoint.errors import CheckpointError
from fsdpkit.checkpoint.export import export
from fsdpkit.checkpoint.hf import hf_config, llama_config, load_hf_weights
from fsdpkit.checkpoint.layout import (
    Entry,
    VerifyReport,
    complete_entries,
    list_entries,
    read_meta,
    step_dir_name,
    verify,
)
from fsdpkit.checkpoint.retention import steps_to_delete
from fsdpkit.checkpoint.signals import any_rank, install_sigterm_flag
from fsdpkit.checkpoint.state import ModelOptimizerState, RankLocal, RNGState
from fsdpkit.checkpoint.summary import inspect_checkpoint, list_run

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "Entry",
    "ModelOptimizerState",
    "RNGState",
    "RankLocal",
    "VerifyReport",
    "any_rank",
    "complete_entries",
    "export",
    "hf_config",
    "inspect_checkpoint",
    "install_sigterm_flag",
    "list_entries",
    "list_run",
    "llama_config",
    "load_hf_weights",
    "read_meta",
    "step_dir_name",
    "steps_to_delete",
    "verify",
]
