"""Helpers for testing distributed code on CPU: a multi-process spawn harness for
users' own tests (and the demo). fsdpkit's own test fixtures (tiny HF models, nodes
made of network namespaces, a SLURM cluster) live outside the package, in tests/ and
examples/, so the wheel carries only what users call."""

from fsdpkit.testing.spawn import RankFailure, run_ranks

__all__ = ["RankFailure", "run_ranks"]
