"""Run-dir checks and whole-line writes (fsdpkit.runtime.rundir): a run dir that cannot be
one, a full disk, a torn last line."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdpkit.runtime.rundir import RunDirError, append_line, check_run_dir, read_jsonl


def test_run_dir_checks_and_whole_line_writes(tmp_path: Path) -> None:
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(RunDirError, match="is a regular file"):
        check_run_dir(afile)
    with pytest.raises(RunDirError, match="cannot be created"):
        check_run_dir(afile / "run")
    check_run_dir(tmp_path / "new" / "run")
    assert (tmp_path / "new" / "run").is_dir() and not list((tmp_path / "new" / "run").iterdir())

    full = tmp_path / "metrics.jsonl"
    full.symlink_to("/dev/full")
    with pytest.raises(RunDirError, match="the disk is full"):
        append_line(full, {"step": 1}, what="the metrics file")
    torn = tmp_path / "torn.jsonl"
    torn.write_text('{"step": 1}\n{"step": 2, "lo')
    assert read_jsonl(torn) == [{"step": 1}]
