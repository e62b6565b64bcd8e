"""Sharded checkpoints that never lose work: atomic, async, verified, resumable at any
world size, convertible to and from Hugging Face safetensors.

Modules, each owning one thing:
    layout        directory layout, completion marker, verify
    checksum      crc32 at memory speed (zlib-ng), per file
    writer        DCP writer that checksums bytes as they are written, fsyncs, writes behind
    staging       reused host buffers for async saves; their size for the planner
    reader        DCP reader that loads each byte once and verifies while it reads
    records       where a tensor's bytes sit inside a DCP item (no torch.load)
    untrusted     checksum-gated, restricted unpickling of ``.metadata``; safe planner
    retention     which complete checkpoints to delete (pure)
    state         Stateful adapters: model+optimizer, rank-local state, RNG streams
    checkpointer  Checkpointer: save (sync/async), retention, resume
    resume        choose the checkpoint to resume from, precheck, load it
    signals       stop-signal flag (SIGTERM, SIGINT, SIGHUP) and cross-rank agreement
    hf / export   HF config, load_hf_weights, offline export (hf | torch)
    summary       inspect / list data for the CLI

Security: nothing read from a checkpoint runs code ([Note: untrusted checkpoints]).
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
from fsdpkit.checkpoint.signals import any_rank, install_sigterm_flag, install_stop_flag
from fsdpkit.checkpoint.staging import async_staging_bytes
from fsdpkit.checkpoint.state import ModelOptimizerState, RankLocal, RNGState
from fsdpkit.checkpoint.summary import inspect_checkpoint, list_run
from fsdpkit.checkpoint.untrusted import UnsafeCheckpointError

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "Entry",
    "ModelOptimizerState",
    "RNGState",
    "RankLocal",
    "UnsafeCheckpointError",
    "VerifyReport",
    "any_rank",
    "async_staging_bytes",
    "complete_entries",
    "export",
    "hf_config",
    "inspect_checkpoint",
    "install_sigterm_flag",
    "install_stop_flag",
    "list_entries",
    "list_run",
    "llama_config",
    "load_hf_weights",
    "read_meta",
    "step_dir_name",
    "steps_to_delete",
    "verify",
]
