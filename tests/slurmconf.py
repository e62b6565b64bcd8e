"""The files of the one-machine SLURM test cluster (tests/slurmcluster.py):
``slurm.conf`` and where each daemon keeps its state, all under one work directory.

Pure: paths and text from a layout, so the cluster module only starts processes.

[Note: SLURM test timeouts]
SLURM's defaults are minutes where a test has seconds: slurmctld pings its slurmds
every SlurmdTimeout / 3 and marks one DOWN after SlurmdTimeout (300 s by default);
a message waits MessageTimeout (10 s); a signalled job gets KillWait (30 s) between
SIGTERM and SIGKILL. The test cluster uses SlurmdTimeout = 6, MessageTimeout = 3,
TCPTimeout = 2 and KillWait = KILL_WAIT_S, so a dead node is noticed within seconds
and a job still has a real grace period to save in. ``SlurmdParameters =
config_overrides``: every slurmd runs on the same machine, and its hardware need
not match what the config gives it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

KILL_WAIT_S = 10
"""Seconds between SIGTERM and SIGKILL when a job is cancelled, requeued or runs out
of time: the grace a job has to save ([Note: SLURM test timeouts])."""
SLURMD_TIMEOUT_S = 6
PARTITION = "debug"


@dataclass(frozen=True)
class SlurmNode:
    name: str
    """NodeName (and host name inside the namespaces: ``/etc/netns/NS/hosts``)."""
    address: str
    """NodeAddr: the node namespace's own address."""


@dataclass(frozen=True)
class Layout:
    """Where the cluster keeps everything (one directory, removed with the cluster)."""

    workdir: Path

    @property
    def conf(self) -> Path:
        return self.workdir / "slurm.conf"

    @property
    def cgroup_conf(self) -> Path:
        return self.workdir / "cgroup.conf"

    @property
    def munge_key(self) -> Path:
        return self.workdir / "munge" / "munge.key"

    @property
    def munge_socket(self) -> Path:
        return self.workdir / "munge" / "munge.socket"

    @property
    def state(self) -> Path:
        return self.workdir / "state"

    @property
    def logs(self) -> Path:
        return self.workdir / "log"

    def spool(self, node: str) -> Path:
        return self.workdir / "spool" / node

    def slurmd_log(self, node: str) -> Path:
        return self.logs / f"slurmd-{node}.log"

    @property
    def slurmctld_log(self) -> Path:
        return self.logs / "slurmctld.log"

    @property
    def munged_log(self) -> Path:
        return self.logs / "munged.log"

    def directories(self) -> list[Path]:
        """Directories to make before a daemon starts (munged checks their modes)."""
        return [self.munge_key.parent, self.state, self.logs, self.workdir / "cgroup"]


def cgroup_conf(*, layout: Layout) -> str:
    """``cgroup.conf``: slurmd loads a cgroup plugin whatever else is configured, and
    its autodetection fails inside ``ip netns exec``, which mounts a sysfs of the
    namespace over /sys (no /sys/fs/cgroup). cgroup/v1 named outright, pointed at an
    empty directory, loads; nothing here uses it (proctrack/pgid, task/none)."""
    return f"CgroupPlugin=cgroup/v1\nCgroupMountpoint={layout.workdir / 'cgroup'}\n"


def slurm_conf(
    *,
    layout: Layout,
    controller_host: str,
    controller_address: str,
    nodes: Sequence[SlurmNode],
    cpus: int,
) -> str:
    """``slurm.conf`` for a cluster of ``nodes`` with slurmctld at
    ``controller_address`` (its host name must be this machine's: slurmctld checks it);
    everything root, no accounting, no cgroups ([Note: SLURM test timeouts])."""
    w = layout.workdir
    lines = [
        "ClusterName=fsdpk",
        f"SlurmctldHost={controller_host}({controller_address})",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={layout.munge_socket}",
        f"StateSaveLocation={layout.state}",
        f"SlurmdSpoolDir={w / 'spool' / '%n'}",
        f"SlurmctldPidFile={w / 'slurmctld.pid'}",
        f"SlurmdPidFile={w / 'spool' / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={layout.slurmctld_log}",
        f"SlurmdLogFile={layout.logs / 'slurmd-%n.log'}",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "ProctrackType=proctrack/pgid",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SchedulerType=sched/builtin",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "MailProg=/bin/true",
        "ReturnToService=1",
        "SlurmdParameters=config_overrides",
        f"SlurmdTimeout={SLURMD_TIMEOUT_S}",
        "SlurmctldTimeout=10",
        "MessageTimeout=3",
        "TCPTimeout=2",
        f"KillWait={KILL_WAIT_S}",
        "InactiveLimit=0",
        "MinJobAge=600",
    ]
    lines += [f"NodeName={n.name} NodeAddr={n.address} CPUs={cpus} State=UNKNOWN" for n in nodes]
    lines.append(f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"
