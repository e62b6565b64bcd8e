"""A real SLURM cluster for these tests ([Note: SLURM test cluster] in
tests/slurmcluster.py): munge, slurmctld and two slurmds, each in a network
namespace of its own, started once per session and removed with everything in it at
the end. Skipped, saying why, where it cannot run (not root, no ``ip``, SLURM not
installed: ``make test`` runs tests/slurm/install.sh first, as root).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "e2e"))  # clirun, factories

import netns
import slurmcluster

REQUIRE_VAR = "FSDPKIT_REQUIRE_SLURM"
"""Set (CI does, as root with Debian's mirror): a cluster that cannot be made fails the
SLURM tests instead of skipping them, so a broken install never passes as green."""


@pytest.fixture(scope="session")
def slurm_possible() -> None:
    """Skip where no cluster can be made (saying why); fail instead under
    ``REQUIRE_VAR``. Every SLURM test asks this, through ``slurm_cluster`` or itself."""
    why = slurmcluster.unavailable()
    if why is not None and os.environ.get(REQUIRE_VAR):
        pytest.fail(f"no SLURM test cluster, and ${REQUIRE_VAR} requires one: {why}")
    if why is not None:
        pytest.skip(f"no SLURM test cluster: {why}")


@pytest.fixture(scope="session")
def slurm_cluster(slurm_possible: None) -> Iterator[slurmcluster.SlurmCluster]:
    netns.remove_stale()
    slurmcluster.remove_stale_workdirs()
    with slurmcluster.cluster(nodes=2) as made:
        yield made


@pytest.fixture
def slurm(
    slurm_cluster: slurmcluster.SlurmCluster, tmp_path: Path
) -> Iterator[slurmcluster.SlurmCluster]:
    """The session's cluster with every node idle and no job left from a test before;
    the daemons' logs are copied to ``tmp_path/slurm-logs`` afterwards (kept by pytest
    for the last runs: what to read when a scenario failed)."""
    slurm_cluster.cancel_all()
    slurm_cluster.wait_idle()
    yield slurm_cluster
    slurm_cluster.save_logs(tmp_path / "slurm-logs")


RESULTS_VAR = "FSDPKIT_SLURM_RESULTS"
"""Where the scenarios write what they measured (bench/slurm_scenarios.py sets it)."""


@pytest.fixture(scope="session")
def record() -> Iterator[Callable[..., None]]:
    """``record(scenario=..., happens=..., seconds=..., command=...)``: a row of the
    "SLURM, tested" table, written to ``$FSDPKIT_SLURM_RESULTS`` at the session's end."""
    rows: list[dict[str, object]] = []
    yield lambda **row: rows.append(row)
    target = os.environ.get(RESULTS_VAR)
    if target:
        Path(target).write_text(json.dumps(rows, indent=1) + "\n")
