"""``fsdpkit doctor`` inside a SLURM allocation: the nodes, tasks and network the job
sees, as a training job would derive them ([Note: SLURM join] in fsdpkit.runtime.slurm).

    salloc -N 2 fsdpkit doctor                      # or in an sbatch script
    srun --ntasks-per-node=1 fsdpkit doctor         # + the network across the nodes

Checks (section "slurm"): the allocation (job, nodes, tasks per node, where this
process runs); the rendezvous (MASTER_ADDR = the first node, resolved here, the
port, and the interface this node reaches it through: the one gloo / NCCL bind to);
every node's name resolving to an address of its own. Run as one task per node
(``srun --ntasks-per-node=1``), ``network_options`` gives the doctor's network part
SLURM's endpoint, node count and node rank, so the nodes meet, compare versions and
measure all-reduce over the real links without any option.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass

from fsdpkit import netinfo
from fsdpkit.doctor.check import Check, fail, ok
from fsdpkit.runtime import slurm


@dataclass(frozen=True)
class Allocation:
    """What SLURM's variables say about this job and this process."""

    job_id: str
    hosts: tuple[str, ...]
    tasks: int | None
    """SLURM_NTASKS (None: not set, e.g. ``salloc -N 2`` without -n)."""
    tasks_per_node: str | None
    node_id: int | None
    node_name: str | None
    task: int | None
    """SLURM_PROCID inside an ``srun`` step; None in the batch script or salloc shell."""
    step_tasks_here: int | None
    """This step's tasks on this node (SLURM_STEP_TASKS_PER_NODE), inside a step."""

    def describe(self) -> str:
        where = f"node {self.node_id} ({self.node_name})" if self.node_name else "the login node"
        task = f", task {self.task}" if self.task is not None else ""
        tasks = f"{self.tasks} task(s) ({self.tasks_per_node} per node)" if self.tasks else (
            "no task count (SLURM_NTASKS unset)"
        )  # fmt: skip
        return (
            f"job {self.job_id}: {len(self.hosts)} node(s) {', '.join(self.hosts)}; {tasks}; "
            f"here: {where}{task}"
        )


def allocation(environ: Mapping[str, str]) -> Allocation | None:
    """The allocation this process runs in, or None outside SLURM."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    job = environ.get("SLURM_JOB_ID")
    if not job or not nodelist:
        return None
    node_id = environ.get("SLURM_NODEID")
    in_step = slurm.in_task(environ)
    step_here = None
    if in_step and environ.get("SLURM_STEP_TASKS_PER_NODE"):
        step_here = slurm.tasks_on_node(environ["SLURM_STEP_TASKS_PER_NODE"], int(node_id or 0))
    return Allocation(
        job_id=job,
        hosts=tuple(slurm.hosts(nodelist)),
        tasks=int(environ["SLURM_NTASKS"]) if environ.get("SLURM_NTASKS") else None,
        tasks_per_node=environ.get("SLURM_TASKS_PER_NODE"),
        node_id=int(node_id) if node_id else None,
        node_name=environ.get("SLURMD_NODENAME"),
        task=int(environ["SLURM_PROCID"]) if in_step else None,
        step_tasks_here=step_here,
    )


def _resolve(host: str) -> str | None:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def rendezvous_check(alloc: Allocation, environ: Mapping[str, str]) -> Check:
    """MASTER_ADDR / MASTER_PORT as the job's ranks will use them, and the route here."""
    host = environ.get("MASTER_ADDR") or alloc.hosts[0]
    port = environ.get("MASTER_PORT") or str(slurm.master_port(alloc.job_id))
    address = _resolve(host)
    if address is None:
        return fail(
            "slurm rendezvous",
            f"MASTER_ADDR {host} (the first node of the allocation) does not resolve on this node",
            "export MASTER_ADDR=<that node's address> in the job script, or fix the "
            "nodes' name resolution (/etc/hosts, DNS)",
        )
    if len(alloc.hosts) == 1:
        return ok("slurm rendezvous", f"one node: rank 0 hosts the store on 127.0.0.1:{port}")
    try:
        local = netinfo.local_address_for(address)
    except OSError as exc:
        return fail(
            "slurm rendezvous",
            f"MASTER_ADDR {host} = {address}: no route from this node ({exc.strerror or exc})",
            "check the nodes' network (routes, firewall) or export MASTER_ADDR",
        )
    iface = netinfo.interface_of(local) or "?"
    return ok(
        "slurm rendezvous",
        f"MASTER_ADDR {host} = {address}, MASTER_PORT {port}; this node reaches it from "
        f"{local} on {iface}, the interface gloo / NCCL bind to",
    )


def nodes_check(alloc: Allocation) -> Check:
    """Every node of the allocation resolves, each to an address of its own."""
    addresses = {host: _resolve(host) for host in alloc.hosts}
    missing = [h for h, a in addresses.items() if a is None]
    if missing:
        return fail(
            "slurm nodes",
            f"{', '.join(missing)} do(es) not resolve on this node",
            "fix the nodes' name resolution (/etc/hosts, DNS): ranks reach rank 0 by name",
        )
    seen = ", ".join(f"{h} = {a}" for h, a in addresses.items())
    if len(alloc.hosts) > 1 and len(set(addresses.values())) < len(alloc.hosts):
        return fail("slurm nodes", f"two nodes share an address: {seen}",
                    "fix the nodes' name resolution")  # fmt: skip
    return ok("slurm nodes", seen)


def slurm_checks(environ: Mapping[str, str]) -> list[Check]:
    """The "slurm" section: empty outside an allocation."""
    alloc = allocation(environ)
    if alloc is None:
        return []
    return [
        ok("slurm allocation", alloc.describe()),
        rendezvous_check(alloc, environ),
        nodes_check(alloc),
    ]


def network_options(environ: Mapping[str, str]) -> tuple[str, int, int] | None:
    """(endpoint, nodes, node rank) for the doctor's network part when it runs as one
    ``srun`` task per node of a multi-node allocation; else None."""
    alloc = allocation(environ)
    if alloc is None or alloc.task is None or len(alloc.hosts) < 2 or alloc.step_tasks_here != 1:
        return None
    nnodes = int(environ.get("SLURM_STEP_NUM_NODES") or len(alloc.hosts))
    if nnodes < 2:
        return None
    step_nodes = environ.get("SLURM_STEP_NODELIST")
    host = environ.get("MASTER_ADDR") or (
        slurm.first_host(step_nodes) if step_nodes else alloc.hosts[0]
    )
    port = environ.get("MASTER_PORT") or str(slurm.master_port(alloc.job_id))
    return f"{host}:{port}", nnodes, int(alloc.node_id or 0)
