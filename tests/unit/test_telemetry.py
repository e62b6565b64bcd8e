"""metrics.jsonl history across restarts."""

from __future__ import annotations

import json
from pathlib import Path

from fsdpkit.train.telemetry import MetricsWriter
from fsdpkit.version import written_by


def test_restart_keeps_history_up_to_the_resumed_step_and_drops_torn_lines(
    tmp_path: Path,
) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.5}\n'
        '{"step": 3, "loss": 2.0}\n{"step": 4, "lo'
    )
    writer = MetricsWriter(path, enabled=True)
    writer.start(resumed_step=2)
    writer.write({"step": 3, "loss": 1.9})
    writer.write({"step": 4, "loss": 1.8})
    versions = json.dumps(written_by())[1:-1]  # the first record of a process names them
    assert path.read_text().splitlines() == [
        '{"step": 1, "loss": 3.0}',
        '{"step": 2, "loss": 2.5}',
        '{"step": 3, "loss": 1.9, ' + versions + "}",
        '{"step": 4, "loss": 1.8}',
    ]
    writer.start(resumed_step=0)
    assert path.read_text() == ""
