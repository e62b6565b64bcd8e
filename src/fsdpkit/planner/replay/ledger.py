"""A running account of live bytes per category that remembers its peak."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fsdpkit.planner.shapes.result import CATEGORIES, PeakPoint


class Ledger:
    """Live bytes per category; ``add`` keeps the peak and where it happened.

    The simulation sets ``phase``/``where`` before each region so the peak can say
    "backward of layers.31" rather than just a number.
    """

    def __init__(self) -> None:
        self.live: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.total = 0
        self.phase = "forward"
        self.where = ""
        self.peak = PeakPoint(0, "forward", "start", dict(self.live))
        self.phase_peaks: dict[str, int] = {}

    def at(self, phase: str, where: str) -> None:
        self.phase, self.where = phase, where
        self._note()

    def add(self, category: str, nbytes: int) -> None:
        if nbytes:
            self.live[category] += nbytes
            self.total += nbytes
            self._note()

    def apply(self, events: Iterable[tuple[str, int]]) -> None:
        for category, nbytes in events:
            self.add(category, nbytes)

    def apply_summary(self, summary: EventSummary) -> None:
        """``apply`` of the events ``summary`` was folded from, in one go."""
        if summary.peak > 0:
            for category, nbytes in summary.at_peak:
                self.live[category] += nbytes
            self.total += summary.peak
            self._note()
            for category, nbytes in summary.at_peak:
                self.live[category] -= nbytes
            self.total -= summary.peak
        for category, nbytes in summary.net:
            self.live[category] += nbytes
            self.total += nbytes
        self._note()

    def _note(self) -> None:
        if self.total > self.phase_peaks.get(self.phase, -1):
            self.phase_peaks[self.phase] = self.total
        if self.total > self.peak.bytes:
            self.peak = PeakPoint(self.total, self.phase, self.where, dict(self.live))


@dataclass(frozen=True)
class EventSummary:
    """An event sequence folded once: its highest prefix, the per-category prefix at
    that point, and its net effect. Applying it equals applying the events, for the
    total, the peak and the breakdown at the peak (blocks repeat, events don't)."""

    peak: int
    at_peak: tuple[tuple[str, int], ...]
    net: tuple[tuple[str, int], ...]


def summarize(events: Iterable[tuple[str, int]]) -> EventSummary:
    running: dict[str, int] = {}
    total = best = 0
    at_best: dict[str, int] = {}
    for category, nbytes in events:
        running[category] = running.get(category, 0) + nbytes
        total += nbytes
        if total > best:
            best, at_best = total, dict(running)
    return EventSummary(best, tuple(at_best.items()), tuple(running.items()))
