"""The test cluster leaves nothing behind ([Note: SLURM test cluster]): however the
process that made it ends (its block left, Ctrl-C, SIGKILL), no munged, slurmctld,
slurmd, job process, namespace or work directory is left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import netns

pytestmark = pytest.mark.distributed

TESTS = Path(__file__).resolve().parents[1]
"""tests/: the cluster's modules (slurmcluster, netns), which the maker imports."""
MAKER = """
import sys, time
import slurmcluster
with slurmcluster.cluster(nodes=2) as c:
    job = c.run(["sbatch", "--parsable", "-N2", "--output=/dev/null", "--wrap",
                 "srun sleep 300"]).stdout.strip()
    c.wait(int(job), until=("RUNNING",))
    print(c.layout.workdir, flush=True)
    time.sleep(600)
"""


def _as_from_a_terminal() -> None:
    """Ctrl-C at its default in the maker, as in a terminal: a shell without job control
    (make's ``pytest ... &``) starts background commands with SIGINT ignored, and Python
    then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _daemons(workdir: str) -> list[int]:
    """Processes whose command line names the work directory (every daemon does)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if workdir.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    out.append(int(entry))
            except OSError:
                continue
    return out


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "sigkill"])
def test_nothing_is_left_after_the_maker_dies(how: signal.Signals, slurm_possible: None) -> None:
    path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    maker = subprocess.Popen([sys.executable, "-c", MAKER], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": path},
                             preexec_fn=_as_from_a_terminal)  # fmt: skip
    try:
        workdir = maker.stdout.readline().strip()  # type: ignore[union-attr]
        assert workdir, "the cluster did not come up"
        names = [n for n in netns.ours() if n.startswith(f"{netns.PREFIX}-{maker.pid}-")]
        assert len(names) == 3 and _daemons(workdir)
        maker.send_signal(how)
        maker.wait(timeout=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (
            _daemons(workdir) or set(names) & set(netns.ours()) or Path(workdir).exists()
        ):
            time.sleep(0.2)
        assert not _daemons(workdir), "a daemon survived"
        assert not set(names) & set(netns.ours()), "a namespace survived"
        assert not Path(workdir).exists()
    finally:
        if maker.poll() is None:
            maker.kill()
