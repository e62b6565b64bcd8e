"""Tests on two "nodes" made of network namespaces ([Note: netns lifetime] in
tests/netns.py): skipped, saying why, only where namespaces cannot be made
(not root, no ``ip``); CI runs them as root.

Namespaces an interrupted run left behind (their creating pid is gone) are deleted,
with any process inside them, when the session starts and ends.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "e2e"))  # clirun, factories

import netns


@pytest.fixture(scope="session", autouse=True)
def _stale_namespaces() -> Iterator[None]:
    """Before the first test here and after the session: delete what killed runs left
    (a conftest below the root sees no ``pytest_sessionstart``)."""
    if netns.unavailable() is None:
        netns.remove_stale()
    yield
    if netns.unavailable() is None:
        netns.remove_stale()


@pytest.fixture
def nodes() -> Iterator[netns.Cluster]:
    """Two namespaces on one bridge, removed after the test whatever happens."""
    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"no network namespaces: {why}")
    with netns.cluster(nodes=2) as made:
        yield made
