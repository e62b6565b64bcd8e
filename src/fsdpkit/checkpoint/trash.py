"""Checkpoints that retention dropped, removed off the save's critical path.

[Note: retention in the background]
Deleting a checkpoint is unlinking files as large as the model's state, which the
kernel pays for by freeing their pages: with bench/checkpoint_io.py's model (keep=1)
rank 0's unlinks of the previous checkpoint took 0.1-0.16 s of a 0.5 s save, time
every rank then waited for at the next collective. So retention (rank 0) only
renames a dropped ``checkpoints/step-N`` into ``.checkpoints-deleting/`` beside
``checkpoints/`` (same directory, so the same file system: the rename is atomic and
moves no bytes) and a thread unlinks it while training goes on:

- ``checkpoints/`` holds complete checkpoints and in-flight ``.tmp`` saves only, at
  every moment: a listing right after ``save()`` (``ls``, ``fsdpkit ckpt list``, resume)
  never sees a half-deleted directory;
- the thread is joined before the next save, before a resume and at close, so two
  removals never overlap and a run that ends has removed what it dropped;
- whatever a dead process left in ``.checkpoints-deleting/`` is removed with the next
  retention; where the rename fails (another file system mounted at ``checkpoints/``,
  permissions) the checkpoint is removed in place, as before.
"""

from __future__ import annotations

import logging
import threading
import uuid
from pathlib import Path

from fsdpkit.checkpoint.stepdir import remove_tree

log = logging.getLogger(__name__)

TRASH = ".checkpoints-deleting"
"""Directory beside ``checkpoints/`` holding dropped checkpoints until they are gone."""


def trash_dir(root: Path) -> Path:
    """Where the checkpoints of ``root`` (``run_dir/checkpoints``) go to be removed."""
    return root.parent / TRASH


def set_aside(path: Path, *, root: Path) -> bool:
    """Move the checkpoint ``path`` out of ``root`` into its trash directory; False when
    that fails (the caller then removes it in place)."""
    trash = trash_dir(root)
    try:
        trash.mkdir(exist_ok=True)
        path.rename(trash / f"{path.name}.{uuid.uuid4().hex[:8]}")
    except OSError as exc:
        log.debug("checkpoint: cannot set %s aside (%s); removing it in place", path, exc)
        return False
    return True


class Remover:
    """Rank 0's background removal of the trash directory of one checkpoints root."""

    def __init__(self, root: Path) -> None:
        self._trash = trash_dir(root)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Remove everything in the trash (this save's drops and a dead process's
        leftovers) on a thread; joins a previous removal first."""
        self.join()
        if not self._trash.is_dir():
            return
        self._thread = threading.Thread(
            target=remove_tree, args=(self._trash,), name="fsdpkit-ckpt-retention", daemon=True
        )
        self._thread.start()

    def join(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
