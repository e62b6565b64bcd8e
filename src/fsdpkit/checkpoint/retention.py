"""Which checkpoints to delete: pure logic, tested without a file system.

[Note: retention]
Only complete checkpoints count and only complete checkpoints are candidates. Kept: the
newest ``keep``, every step that is a multiple of ``keep_every`` (when > 0), and always
the newest complete one. Retention runs only after a save has completed, so the newest
complete checkpoint before that save is never deleted before a newer one exists.
"""

from __future__ import annotations

from collections.abc import Iterable


def steps_to_delete(complete_steps: Iterable[int], *, keep: int, keep_every: int) -> list[int]:
    """Steps of complete checkpoints that the policy no longer keeps, oldest first."""
    ordered = sorted(set(complete_steps))
    if not ordered:
        return []
    kept = set(ordered[-max(keep, 1) :])
    if keep_every > 0:
        kept |= {s for s in ordered if s % keep_every == 0}
    return [s for s in ordered if s not in kept]
