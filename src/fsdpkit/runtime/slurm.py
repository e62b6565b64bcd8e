"""SLURM: what its task environment means for torch, and a batch script that runs it.

``srun python -m fsdpkit train run.toml`` starts one task per rank; each task joins
([Note: SLURM join]). ``fsdpkit train --slurm-script ...`` prints an sbatch file for
the same command. Pure functions of an environment mapping: fsdpkit.runtime.launch reads the
real environment and applies the result.

[Note: SLURM join]
RANK = SLURM_PROCID, WORLD_SIZE = SLURM_NTASKS, LOCAL_RANK = SLURM_LOCALID,
LOCAL_WORLD_SIZE = this node's entry of SLURM_TASKS_PER_NODE (``"4(x2),2"`` = 4 on
nodes 0-1, 2 on node 2; SLURM_NODEID picks the entry). MASTER_ADDR defaults to the
first host of SLURM_NODELIST (task 0 runs there) and MASTER_PORT to
``10000 + SLURM_JOB_ID mod 10000`` (below the kernel's ephemeral range, and the same
for every task of the job); export either to override.

[Note: repeated SLURM signals]
When SLURM ends a job (``scontrol requeue``, ``scancel``, the time limit), slurmd sends
SIGTERM to every step: the training tasks, and the batch script with its ``srun``,
which forwards the SIGTERM it got to the same tasks. So a task gets the first signal
twice, a fraction of a second apart. Outside SLURM a second signal means "stop now,
without saving" ([Note: second signal] in fsdpkit.runtime.signals); in a SLURM task
the same signal again is ignored, so the save the first one asked for completes. A
different signal still stops at once, and SLURM's own "now" is SIGKILL after KillWait.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping, Sequence

PORT_BASE = 10000


def lost_node(message: str, env: Mapping[str, str]) -> str | None:
    """A SLURM task's error that only says a peer went away, as the one paragraph of
    [Note: lost node] naming that node (its address looked up among the job's hosts);
    None for any other error, or outside a SLURM task."""
    from fsdpkit.runtime import failures

    if not in_task(env) or not failures.is_secondary(message):
        return None
    address = failures.lost_peer(message)
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    names = [h for h in hosts(nodelist) if _address(h) == address] if nodelist else []
    node, per_node = int(env.get("SLURM_NODEID", "0")), env.get("SLURM_TASKS_PER_NODE", "1")
    first = sum(tasks_on_node(per_node, n) for n in range(node))
    local = list(range(first, first + tasks_on_node(per_node, node)))
    return failures.describe_lost_node(
        message, local_ranks=local, world_size=int(env.get("SLURM_NTASKS", "1")),
        name=names[0] if names else None,
    )  # fmt: skip


def _address(host: str) -> str | None:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def in_task(env: Mapping[str, str]) -> bool:
    """Whether this process is a task srun started ([Note: repeated SLURM signals])."""
    return "SLURM_PROCID" in env and "SLURM_STEP_ID" in env


def hosts(nodelist: str) -> list[str]:
    """Every host of a SLURM host list, in order: ``node[07-09,12],gpu1`` -> node07,
    node08, node09, node12, gpu1 (zero padding kept)."""
    out: list[str] = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip()):
        prefix, ranges = match.group(1), match.group(2)
        if not ranges:
            out.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ValueError(f"cannot read SLURM_NODELIST {nodelist!r}")
            out += [f"{prefix}{n:0{len(lo)}d}" for n in range(int(lo), int(hi or lo) + 1)]
    if not out:
        raise ValueError(f"cannot read SLURM_NODELIST {nodelist!r}")
    return out


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: ``node[07-09,12],gpu1`` -> ``node07``."""
    return hosts(nodelist)[0]


def tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """This node's task count from SLURM_TASKS_PER_NODE (``"4(x2),2"``, node 2 -> 2)."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ValueError(f"cannot read SLURM_TASKS_PER_NODE {tasks_per_node!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[min(node_id, len(counts) - 1)]


def master_port(job_id: str) -> int:
    """The job's default rendezvous port ([Note: SLURM join])."""
    digits = re.sub(r"\D", "", job_id) or "0"
    return PORT_BASE + int(digits) % 10000


def torch_env(slurm: Mapping[str, str]) -> dict[str, str]:
    """torch's env:// variables for a SLURM task ([Note: SLURM join]); {} when the
    mapping is not a SLURM task's or RANK is already set."""
    if "RANK" in slurm or "SLURM_PROCID" not in slurm or "SLURM_NTASKS" not in slurm:
        return {}
    node = int(slurm.get("SLURM_NODEID", "0"))
    per_node = slurm.get("SLURM_NTASKS_PER_NODE") or slurm.get("SLURM_TASKS_PER_NODE", "1")
    out = {
        "RANK": slurm["SLURM_PROCID"],
        "WORLD_SIZE": slurm["SLURM_NTASKS"],
        "LOCAL_RANK": slurm.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": str(tasks_on_node(per_node, node)),
    }
    if "MASTER_ADDR" not in slurm and slurm.get("SLURM_NODELIST"):
        out["MASTER_ADDR"] = first_host(slurm["SLURM_NODELIST"])
    if "MASTER_PORT" not in slurm and slurm.get("SLURM_JOB_ID"):
        out["MASTER_PORT"] = str(master_port(slurm["SLURM_JOB_ID"]))
    return out


def sbatch_script(
    *, items: Sequence[str], nodes: int, tasks_per_node: int, gpus: bool, python: str = "python"
) -> str:
    """An sbatch file that runs ``fsdpkit train *items`` on ``nodes`` x
    ``tasks_per_node`` ranks (one task per GPU): ``fsdpkit slurm``'s script
    (fsdpkit.runtime.sbatch) with SLURM's default log and the default signal."""
    from fsdpkit.runtime.sbatch import JobSpec, render

    spec = JobSpec(
        items=tuple(items), nodes=nodes, tasks_per_node=tasks_per_node, gpus=gpus, python=python
    )
    return render(spec)
