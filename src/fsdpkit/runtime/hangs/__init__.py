"""Hang triage built into ``fsdpkit train``: who is behind, where, in which collective.

    probe = HangProbe.start(rank=..., run_dir=..., control=..., timeout_s=..., hang_timeout_s=...)
    run(session, probe=probe)          # the loop moves the probe at each phase boundary
    with HangWatch(control=..., run_dir=..., nproc=..., stall_s=..., timeout_s=...) as watch:
        elastic_launch(...)            # the launcher: watch.report after a hang

Modules, one job each:
    record   a rank's progress in 128 shared bytes ([Note: progress record])
    flight   torch's Flight Recorder: turned on, dumped, summarized ([Note: flight recorder])
    probe    the worker's side ([Note: hang triage, worker side])
    watch    the spawning launcher's side ([Note: hang triage, launcher side])
    behind   which rank is behind, and the report files ([Note: which rank is behind])

docs/runtime.md ("Hangs") says what a report contains and how to read it.
"""

from fsdpkit.runtime.hangs.probe import HangProbe, hang_timeout
from fsdpkit.runtime.hangs.watch import HangReport, HangWatch

__all__ = ["HangProbe", "HangReport", "HangWatch", "hang_timeout"]
