"""Helpers for testing distributed code on CPU: a multi-process spawn harness."""

from fsdpkit.testing.spawn import RankFailure, run_ranks

__all__ = ["RankFailure", "run_ranks"]
