"""The end-of-run table: a sample's control characters are shown escaped, never sent to
the terminal (an untrained byte-level model samples random bytes, ESC among them)."""

from __future__ import annotations

from fsdpkit.config import load
from fsdpkit.train.summary import RunSummary, format_summary, printable


def test_control_characters_in_a_sample_are_escaped() -> None:
    assert printable("a\x1b[2Jb\x07c\x7f") == "a\\x1b[2Jb\\x07c\\x7f"
    assert printable("line one\n\tline two é \ufffd") == "line one\n\tline two é \ufffd"


def test_the_summary_prints_the_escaped_sample() -> None:
    out = format_summary(RunSummary(steps=1, sample_text="def \x1b]0;x\x07 f"), cfg=load(None, []))
    assert "sample:\ndef \\x1b]0;x\\x07 f" in out
    assert "\x1b" not in out and "\x07" not in out
