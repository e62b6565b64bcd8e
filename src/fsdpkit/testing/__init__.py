"""Helpers for testing distributed code on CPU: a multi-process spawn harness, and
nodes made of network namespaces (fsdpkit.testing.netns; Linux, root, iproute2)."""

from fsdpkit.testing.spawn import RankFailure, run_ranks

__all__ = ["RankFailure", "run_ranks"]
