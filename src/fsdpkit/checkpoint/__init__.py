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

if TYPE_CHECKING:  # the names of _HOMES from their modules (tests/unit/test_lazy_faces.py)
    from fsdpkit.checkpoint.checkpointer import Checkpointer as Checkpointer
    from fsdpkit.checkpoint.errors import CheckpointError as CheckpointError
    from fsdpkit.checkpoint.hf_weights import load_hf_weights as load_hf_weights
    from fsdpkit.checkpoint.listing import inspect_checkpoint as inspect_checkpoint
    from fsdpkit.checkpoint.listing import list_run as list_run
    from fsdpkit.checkpoint.retention import steps_to_delete as steps_to_delete
    from fsdpkit.checkpoint.staging import async_staging_bytes as async_staging_bytes
    from fsdpkit.checkpoint.statefuls import ModelOptimizerState as ModelOptimizerState
    from fsdpkit.checkpoint.statefuls import RankLocal as RankLocal
    from fsdpkit.checkpoint.statefuls import RNGState as RNGState
    from fsdpkit.checkpoint.stepdir import Entry as Entry
    from fsdpkit.checkpoint.stepdir import VerifyReport as VerifyReport
    from fsdpkit.checkpoint.stepdir import complete_entries as complete_entries
    from fsdpkit.checkpoint.stepdir import list_entries as list_entries
    from fsdpkit.checkpoint.stepdir import read_meta as read_meta
    from fsdpkit.checkpoint.stepdir import step_dir_name as step_dir_name
    from fsdpkit.checkpoint.stepdir import verify as verify
    from fsdpkit.checkpoint.untrusted import UnsafeCheckpointError as UnsafeCheckpointError

_HOMES = {
    "Checkpointer": "fsdpkit.checkpoint.checkpointer",
    "CheckpointError": "fsdpkit.checkpoint.errors",
    "load_hf_weights": "fsdpkit.checkpoint.hf_weights",
    "inspect_checkpoint": "fsdpkit.checkpoint.listing",
    "list_run": "fsdpkit.checkpoint.listing",
    "steps_to_delete": "fsdpkit.checkpoint.retention",
    "async_staging_bytes": "fsdpkit.checkpoint.staging",
    **dict.fromkeys(
        ["ModelOptimizerState", "RankLocal", "RNGState"], "fsdpkit.checkpoint.statefuls"
    ),
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
    "UnsafeCheckpointError": "fsdpkit.checkpoint.untrusted",
}
"""Where each public name lives: the one list of them ([Note: lazy package faces] in
fsdpkit.lazy)."""

__all__ = sorted(_HOMES)
__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
