"""A real SLURM cluster on one Linux machine: munge, slurmctld and one slurmd per
network namespace (tests/netns.py), for tests that submit with real ``sbatch``.

    with slurmcluster.cluster(nodes=2) as c:
        job = c.submit(script, cwd=tmp_path)
        info = c.wait(job, until=slurmcluster.DONE)

[Note: SLURM test cluster]
``netns.cluster`` gives each node a namespace with one address on a bridge; the
bridge's namespace (the "switch") gets one more address, ``.254``, for the
controller and login node: munged, slurmctld and every client command (sbatch,
scontrol, ...) run there, ``slurmd -N fsdpk-nodeI`` runs inside node I, each daemon
in the foreground. Everything lives in one work directory (tests/slurmconf.py:
the config, munge's own key and Unix socket, which every namespace reaches by path,
state, spools, logs): nothing is read from /etc/slurm or /etc/munge, nothing listens
outside the namespaces. Job steps started by slurmd run inside its node's namespace
and see that node's ``/etc/hosts``, so SLURM_NODELIST's names resolve.

Lifetime: every daemon and every job process lives inside a namespace; teardown
stops the daemons (SIGTERM, then the namespaces' deletion SIGKILLs what is left) and
deletes the work directory. However the creating process ends, SIGKILL included, a
reaper does the same: it blocks reading a pipe whose only writer is the creator, and
at EOF deletes the namespaces of dead creators (``netns.remove_stale``) and the work
directory. A killed reaper is covered by the next session's ``remove_stale``.

[Note: requeue race]
A requeued job keeps its id, and slurmd's spool directory for it (``jobNNNNN``, with
the batch script in it) is named by that id. SLURM holds a requeued job pending for
about two minutes; a test that starts it sooner (``scontrol update starttime=now``)
while the previous run's slurmstepd is still cleaning up has the new run's script
deleted under it ("unlink(.../jobNNNNN/slurm_script): No such file or directory"):
the job fails at once with ExitCode 1:0 and an empty log. ``release`` waits for every
node to be idle first.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import netns
from slurmconf import Layout, SlurmNode, cgroup_conf, slurm_conf

COMMANDS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel",
            "sinfo")  # fmt: skip
WORK_PREFIX = "fsdpk-slurm-"
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
        "BOOT_FAIL", "DEADLINE")  # fmt: skip
"""Job states after which a job runs no more (a requeued job goes PENDING instead)."""
START_S = 60.0


class SlurmClusterError(RuntimeError):
    """A daemon did not come up, or a client command failed; the message has its output."""


def unavailable() -> str | None:
    """Why no cluster can be made here (no namespaces, SLURM or munge missing), or None."""
    why = netns.unavailable()
    if why is not None:
        return why
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        return (
            f"{', '.join(missing)} not installed (tests/slurm/install.sh installs Debian's "
            "slurmctld, slurmd, slurm-client and munge as root; `make test` runs it)"
        )
    return None


@dataclass
class SlurmCluster:
    net: netns.Cluster
    layout: Layout
    controller: str
    """The controller's (and login node's) address, on the switch namespace's bridge."""
    nodes: tuple[SlurmNode, ...]
    daemons: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a client command: this cluster's config."""
        return {**os.environ, **(extra or {}), "SLURM_CONF": str(self.layout.conf)}

    def login(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run on the login node (the controller's namespace)."""
        return ["ip", "netns", "exec", self.net.switch, *argv]

    def run(
        self,
        argv: Sequence[str],
        *,
        check: bool = True,
        timeout: float = 30,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """A client command (sbatch, scontrol, ...) on the login node."""
        result = subprocess.run(
            self.login(argv), env=self.env(env), cwd=cwd, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip
        if check and result.returncode != 0:
            raise SlurmClusterError(
                f"{' '.join(argv)} exited {result.returncode}: {result.stderr.strip()}"
            )
        return result

    def submit(self, script: Path, *args: str, cwd: Path, env: dict[str, str] | None = None) -> int:
        """``sbatch --parsable [args] script`` from ``cwd``; the job id."""
        out = self.run(["sbatch", "--parsable", *args, str(script)], cwd=cwd, env=env)
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, NodeList, Restarts, ...)."""
        out = self.run(["scontrol", "-o", "show", "job", str(job_id)]).stdout
        return dict(part.split("=", 1) for part in out.split() if "=" in part)

    def wait(
        self, job_id: int, *, until: Sequence[str] = DONE, timeout: float = 180
    ) -> dict[str, str]:
        """Poll until the job's state is one of ``until``; its record."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in until:
                return info
            if time.monotonic() > deadline:
                raise SlurmClusterError(f"job {job_id} not in {until} after {timeout} s: {info}")
            time.sleep(0.2)

    def node_states(self) -> dict[str, str]:
        """Node name -> state (``idle``, ``alloc``, ``down*``, ...) from sinfo."""
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def release(self, job_id: int, *, timeout: float = 60) -> dict[str, str]:
        """Start a requeued job now: SLURM holds one for its requeue delay (BeginTime
        about two minutes on), which a test has no time for. Only once every node is
        idle again: the previous run's slurmstepd removes the spool directory named by
        the job id when it ends, and a new run of the same id started before that
        loses its script ([Note: requeue race]). Its record once running."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            states = self.node_states().values()
            if info["JobState"] in DONE or (
                info["JobState"] == "PENDING" and all(s == "idle" for s in states)
            ):
                break
            if time.monotonic() > deadline:
                raise SlurmClusterError(f"job {job_id} not requeued in {timeout} s: {info}")
            time.sleep(0.2)
        if info["JobState"] == "PENDING":
            self.run(["scontrol", "update", f"jobid={job_id}", "starttime=now"])
        return self.wait(job_id, until=("RUNNING", *DONE), timeout=timeout)

    def cancel_all(self) -> None:
        """Cancel every job (one a failed test left behind)."""
        self.run(["scancel", "--full", "--user=root"], check=False)

    def heal(self) -> None:
        """Start again every slurmd that is gone (a test crashed its node)."""
        for index, node in enumerate(self.nodes):
            proc = self.daemons.get(node.name)
            if proc is None or proc.poll() is not None:
                self.start_slurmd(index)

    def wait_idle(self, *, timeout: float = START_S) -> None:
        """Until every node is idle (its slurmd restarted, a down node resumed)."""
        self.heal()
        deadline = time.monotonic() + timeout
        while True:
            states = self.node_states()
            if states and all(s == "idle" for s in states.values()):
                return
            for name, state in states.items():
                if state.startswith(("down", "drain")) and not state.endswith("*"):
                    self.run(
                        ["scontrol", "update", f"nodename={name}", "state=resume"], check=False
                    )
            if time.monotonic() > deadline:
                raise SlurmClusterError(
                    f"nodes not idle after {timeout} s: {states}\n{self.tail()}"
                )
            time.sleep(0.3)

    def start_slurmd(self, index: int) -> None:
        """(Re)start node ``index``'s slurmd in its namespace."""
        node = self.nodes[index]
        self.layout.spool(node.name).mkdir(parents=True, exist_ok=True)
        argv = ["slurmd", "-D", "-N", node.name, "-f", str(self.layout.conf)]
        self.daemons[node.name] = _start(self.net.nodes[index].command(argv), self.layout,
                                         f"slurmd-{node.name}")  # fmt: skip

    def crash_node(self, index: int) -> list[int]:
        """The node loses power: SIGKILL every process in its namespace (slurmd, the job's
        slurmstepd and tasks); the pids killed."""
        found = self.net.nodes[index].pids()
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(KeyError, subprocess.TimeoutExpired):
            self.daemons[self.nodes[index].name].wait(timeout=5)
        return found

    def tail(self, *, lines: int = 40) -> str:
        """The last lines of every daemon log, for a failure message."""
        out = []
        for log in sorted(self.layout.logs.glob("*")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(out)

    def save_logs(self, into: Path) -> None:
        """Copy the daemon logs to ``into`` (kept after the cluster is gone)."""
        shutil.copytree(self.layout.logs, into, dirs_exist_ok=True)


def _start(argv: list[str], layout: Layout, name: str) -> subprocess.Popen[bytes]:
    out = open(layout.logs / f"{name}.out", "ab")  # noqa: SIM115 (the daemon's)
    try:
        env = {**os.environ, "SLURM_CONF": str(layout.conf)}
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, cwd=layout.workdir)  # fmt: skip
    finally:
        out.close()


def _poll(what: str, ok: object, c: SlurmCluster, *, timeout: float = START_S) -> None:
    deadline = time.monotonic() + timeout
    while not ok():  # type: ignore[operator]
        dead = [n for n, p in c.daemons.items() if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            why = f"{', '.join(dead)} exited" if dead else f"not within {timeout} s"
            raise SlurmClusterError(f"{what}: {why}\n{c.tail()}")
        time.sleep(0.1)


def _start_munge(c: SlurmCluster) -> None:
    lay = c.layout
    subprocess.run(["mungekey", "-c", "-k", str(lay.munge_key)], check=True, capture_output=True)
    argv = ["munged", "-F", f"--key-file={lay.munge_key}", f"--socket={lay.munge_socket}",
            f"--pid-file={lay.workdir / 'munged.pid'}", f"--log-file={lay.munged_log}",
            f"--seed-file={lay.workdir / 'munge' / 'seed'}"]  # fmt: skip
    c.daemons["munged"] = _start(c.login(argv), lay, "munged")
    _poll("munged", lay.munge_socket.exists, c)


def _start_daemons(c: SlurmCluster) -> None:
    _start_munge(c)
    argv = ["slurmctld", "-D", "-i", "-f", str(c.layout.conf)]
    c.daemons["slurmctld"] = _start(c.login(argv), c.layout, "slurmctld")
    _poll("slurmctld", lambda: c.run(["scontrol", "ping"], check=False).returncode == 0, c)
    for index in range(len(c.nodes)):
        c.start_slurmd(index)
    c.wait_idle()


def _stop_daemons(c: SlurmCluster) -> None:
    """SIGTERM every daemon, slurmds first; the namespaces' deletion kills stragglers."""
    order = [n for n in c.daemons if n.startswith("slurmd")] + ["slurmctld", "munged"]
    for name in order:
        proc = c.daemons.get(name)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    for name in order:
        proc = c.daemons.get(name)
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _start_reaper(workdir: Path) -> subprocess.Popen[bytes]:
    """The guard of [Note: SLURM test cluster]: cleans up after a creator that died.
    This file run as a script (``reap`` below), so the reaper finds it and its
    neighbours (netns, slurmconf) by its own directory, whatever the creator's path."""
    return subprocess.Popen([sys.executable, __file__, str(workdir)], stdin=subprocess.PIPE,
                            start_new_session=True)  # fmt: skip


def reap(workdir: str) -> None:
    """The reaper's body: wait for EOF on stdin (the creator is gone), then delete the
    namespaces of dead creators and ``workdir``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    sys.stdin.buffer.read()
    time.sleep(0.5)  # a normal teardown is already deleting; let it finish first
    netns.remove_stale()
    shutil.rmtree(workdir, ignore_errors=True)


def remove_stale_workdirs() -> list[Path]:
    """Work directories of creators that are gone (a reaper killed too)."""
    stale = []
    for path in Path(tempfile.gettempdir()).glob(f"{WORK_PREFIX}*"):
        pid = path.name[len(WORK_PREFIX) :].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)
            stale.append(path)
    return stale


def _bring_up(net: netns.Cluster, workdir: Path) -> SlurmCluster:
    controller = net.nodes[0].address.rsplit(".", 1)[0] + ".254"
    for args in (["addr", "add", f"{controller}/24", "dev", "br0"], ["link", "set", "lo", "up"]):
        subprocess.run(["ip", "-n", net.switch, *args], check=True, capture_output=True,
                       timeout=netns.IP_TIMEOUT_S)  # fmt: skip
    layout = Layout(workdir)
    for directory in layout.directories():
        directory.mkdir(parents=True, exist_ok=True)
    nodes = tuple(SlurmNode(n.host, n.address) for n in net.nodes)
    layout.cgroup_conf.write_text(cgroup_conf(layout=layout))
    layout.conf.write_text(
        slurm_conf(layout=layout, controller_host=socket.gethostname().split(".")[0],
                   controller_address=controller, nodes=nodes, cpus=os.cpu_count() or 1)
    )  # fmt: skip
    return SlurmCluster(net=net, layout=layout, controller=controller, nodes=nodes)


@contextlib.contextmanager
def cluster(*, nodes: int = 2, keep_logs: Path | None = None) -> Iterator[SlurmCluster]:
    """A running cluster of ``nodes`` slurmds, removed with everything in it when the
    block ends ([Note: SLURM test cluster]); ``keep_logs``: copy the daemons' logs there
    first."""
    workdir = Path(tempfile.mkdtemp(prefix=f"{WORK_PREFIX}{os.getpid()}-"))
    workdir.chmod(0o755)  # munged wants its socket's directories searchable by all
    reaper = _start_reaper(workdir)
    try:
        with netns.cluster(nodes=nodes) as net:
            made = _bring_up(net, workdir)
            try:
                _start_daemons(made)
                yield made
            finally:
                if keep_logs is not None:
                    made.save_logs(keep_logs)
                _stop_daemons(made)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        assert reaper.stdin is not None
        reaper.stdin.close()
        reaper.wait(timeout=30)


if __name__ == "__main__":
    reap(sys.argv[1])
