"""Sharded checkpoints that never lose work: atomic, async, verified, resumable at any
world size, loading Hugging Face safetensors into a sharded model.

Modules, each owning one thing:
    stepdir       directory layout, completion marker, verify
    checksum      crc32 at memory speed (zlib-ng), per file
    writer        DCP writer that checksums bytes as they are written, fsyncs, writes behind
    staging       reused host buffers for async saves; their size for the planner
    reader        DCP reader that loads each byte once and verifies while it reads
    records       where a tensor's bytes sit inside a DCP item (no torch.load)
    untrusted     checksum-gated, restricted unpickling of ``.metadata``; safe planner
    retention     which complete checkpoints to delete (pure)
    trash         dropped checkpoints set aside and removed on a thread
    statefuls     Stateful adapters: model+optimizer, rank-local state, RNG streams
    checkpointer  Checkpointer: save (sync/async), retention, resume
    resume        choose the checkpoint to resume from, precheck, load it
    hf_weights    load_hf_weights: HF safetensors into an already-sharded model
    hf_convert    transformers' key conversions (fused experts) on the way in
    quantized     quantized model directories, refused by their config.json
    fsdp1         FSDP1 checkpoints into an already-sharded model (``model.init_from``)
    listing       inspect / list data for the CLI

Exports to files others load (HF, peft, merged, torch) are ``fsdpkit.export``; stop
signals are ``fsdpkit.runtime.signals``.

Security: nothing read from a checkpoint runs code ([Note: untrusted checkpoints]).

Names are imported on first use ([Note: lazy package faces] in fsdpkit.lazy): the
planner's ``staging`` rule and ``fsdpkit ckpt inspect`` do not import DCP's planners.
"""

from typing import TYPE_CHECKING

from fsdpkit.lazy import lazy_exports

if TYPE_CHECKING:
    from fsdpkit.checkpoint.checkpointer import Checkpointer
    from fsdpkit.checkpoint.errors import CheckpointError
    from fsdpkit.checkpoint.hf_weights import load_hf_weights
    from fsdpkit.checkpoint.listing import inspect_checkpoint, list_run
    from fsdpkit.checkpoint.retention import steps_to_delete
    from fsdpkit.checkpoint.staging import async_staging_bytes
    from fsdpkit.checkpoint.statefuls import ModelOptimizerState, RankLocal, RNGState
    from fsdpkit.checkpoint.stepdir import (
        Entry,
        VerifyReport,
        complete_entries,
        list_entries,
        read_meta,
        step_dir_name,
        verify,
    )
    from fsdpkit.checkpoint.untrusted import UnsafeCheckpointError

_HOMES = {
    "Checkpointer": "fsdpkit.checkpoint.checkpointer",
    "CheckpointError": "fsdpkit.checkpoint.errors",
    "load_hf_weights": "fsdpkit.checkpoint.hf_weights",
    **dict.fromkeys(
        [
            "Entry",
            "VerifyReport",
            "complete_entries",
            "list_entries",
            "read_meta",
            "step_dir_name",
            "verify",
        ],
        "fsdpkit.checkpoint.stepdir",
    ),
    "steps_to_delete": "fsdpkit.checkpoint.retention",
    "async_staging_bytes": "fsdpkit.checkpoint.staging",
    **dict.fromkeys(
        ["ModelOptimizerState", "RankLocal", "RNGState"], "fsdpkit.checkpoint.statefuls"
    ),
    "inspect_checkpoint": "fsdpkit.checkpoint.listing",
    "list_run": "fsdpkit.checkpoint.listing",
    "UnsafeCheckpointError": "fsdpkit.checkpoint.untrusted",
}
__all__ = [
    "CheckpointError",
    "Checkpointer",
    "Entry",
    "ModelOptimizerState",
    "RNGState",
    "RankLocal",
    "UnsafeCheckpointError",
    "VerifyReport",
    "async_staging_bytes",
    "complete_entries",
    "inspect_checkpoint",
    "list_entries",
    "list_run",
    "load_hf_weights",
    "read_meta",
    "step_dir_name",
    "steps_to_delete",
    "verify",
]
__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
