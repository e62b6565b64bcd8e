"""Observability: run reports (plots + one HTML page), TensorBoard / W&B scalars, the
step profiler with its time breakdown, and the Observer the training loop calls.

One concept per module: ``runlog`` reads and summarizes a run directory, ``plots`` and
``page`` format it, ``report`` ties them together; ``sinks`` sends scalars out;
``breakdown`` turns a trace into categories, ``profiling`` records the trace;
``hardware`` says what ran; ``observer`` is the loop's interface to all of it.
"""

from fsdpkit.observe.report import ReportUnavailable, write_report
from fsdpkit.observe.runlog import RunLog, RunLogError, load_run

__all__ = ["ReportUnavailable", "RunLog", "RunLogError", "load_run", "write_report"]
