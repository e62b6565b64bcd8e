"""The environment variables that change how distributed training behaves: what each
does, and a verdict on its value.

Only variables that are set get a line (plus the Flight Recorder hint on GPUs), so
the report stays short on a clean machine.
"""

from __future__ import annotations

from collections.abc import Callable

from fsdpkit.doctor.check import Check, fail, ok, warn
from fsdpkit.doctor.facts import EnvFacts

DOCS: dict[str, str] = {
    "MASTER_ADDR": "address of rank 0's rendezvous store (env:// init: torchrun, SLURM)",
    "MASTER_PORT": "port of rank 0's rendezvous store",
    "RANK": "this process's global rank: set means `fsdpkit train` joins instead of spawning",
    "WORLD_SIZE": "number of ranks in the job (set by torchrun/SLURM)",
    "LOCAL_RANK": "rank within this node (set by torchrun)",
    "OMP_NUM_THREADS": "CPU threads per process for intra-op math (torchrun sets 1)",
    "CUDA_VISIBLE_DEVICES": "which GPUs this process sees, renumbered from 0",
    "CUDA_LAUNCH_BLOCKING": "synchronous kernel launches (debugging only)",
    "PYTORCH_CUDA_ALLOC_CONF": "caching allocator options "
    "(expandable_segments:True cuts fragmentation)",
    "PYTORCH_ALLOC_CONF": "caching allocator options (newer name of PYTORCH_CUDA_ALLOC_CONF)",
    "TORCH_CPP_LOG_LEVEL": "C++ log level of torch (INFO shows c10d/NCCL set-up messages)",
    "GLOO_SOCKET_IFNAME": "network interface(s) gloo binds to (comma-separated)",
    "NCCL_DEBUG": "NCCL logging: WARN, INFO (topology, transports per ring), TRACE",
    "NCCL_DEBUG_SUBSYS": "which NCCL subsystems log (INIT, COLL, NET, P2P, ...)",
    "NCCL_SOCKET_IFNAME": "interfaces NCCL bootstraps on and uses for socket transport "
    "(prefix match; ^ excludes, = exact)",
    "NCCL_IB_DISABLE": "1 turns InfiniBand/RoCE off",
    "NCCL_IB_HCA": "which InfiniBand adapters/ports NCCL uses",
    "NCCL_P2P_DISABLE": "1 turns GPU peer-to-peer (NVLink/PCIe) off",
    "NCCL_P2P_LEVEL": "how far apart (topology) GPUs may be and still use peer-to-peer",
    "NCCL_SHM_DISABLE": "1 turns NCCL's shared-memory transport off",
    "NCCL_NET_GDR_LEVEL": "when NICs read/write GPU memory directly (GPUDirect RDMA)",
    "NCCL_ALGO": "forces the collective algorithm (Ring, Tree, NVLS, ...)",
    "NCCL_PROTO": "forces the protocol (LL, LL128, Simple)",
    "NCCL_CROSS_NIC": "whether rings may use different NICs on different nodes",
    "NCCL_NVLS_ENABLE": "NVLink SHARP (NVSwitch reductions) on/off",
    "NCCL_BLOCKING_WAIT": "deprecated name of TORCH_NCCL_BLOCKING_WAIT",
    "NCCL_ASYNC_ERROR_HANDLING": "deprecated name of TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "what the watchdog does on a failed or timed-out "
    "collective (3 = abort the communicator and tear down the process, the default)",
    "TORCH_NCCL_BLOCKING_WAIT": "1 makes wait() block the host and raise on timeout (slower)",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "entries of the NCCL Flight Recorder (the last collectives "
    "per rank, dumped on a timeout; 0 = off)",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1 dumps the Flight Recorder when a collective times out",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "file prefix of Flight Recorder dumps (one file per rank)",
    "TORCH_NCCL_ENABLE_MONITORING": "heartbeat monitor that kills a rank whose watchdog is stuck",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "seconds before the heartbeat monitor kills a stuck rank",
    "TORCH_NCCL_AVOID_RECORD_STREAMS": "1 frees collective buffers without recordStream "
    "(lower memory with FSDP)",
    "TORCH_DISTRIBUTED_DEBUG": "DETAIL checks every collective's shapes across ranks (slow)",
}

_FLAG = {"0", "1"}


def _port(value: str) -> tuple[str, str] | None:
    """(problem, fix) for a bad MASTER_PORT, None when fine."""
    if not value.strip().isdigit():
        return f"MASTER_PORT={value!r} is not a port number", "export MASTER_PORT=29500"
    port = int(value)
    if port == 0:
        return (
            "MASTER_PORT=0: ranks cannot agree on a port chosen by the OS (the job hangs)",
            "pick a fixed free port, e.g. export MASTER_PORT=29500",
        )
    if port > 65535:
        return f"MASTER_PORT={port} is above 65535", "export MASTER_PORT=29500"
    return None


def _ifnames(f: EnvFacts, value: str, *, prefix_match: bool) -> tuple[str, str] | None:
    if not f.interfaces:
        return None
    wanted = [v.strip() for v in value.split(",") if v.strip()]
    missing = []
    for name in wanted:
        if name.startswith("^"):
            continue
        exact = name.startswith("=") or not prefix_match
        name = name.lstrip("=")
        found = name in f.interfaces if exact else any(i.startswith(name) for i in f.interfaces)
        if not found:
            missing.append(name)
    if missing:
        return (
            f"no interface named {', '.join(missing)} on this machine "
            f"(it has {', '.join(f.interfaces)})",
            "set it to the interface on the network the nodes share (ip -br addr)",
        )
    return None


def _threads(f: EnvFacts, value: str) -> tuple[str, str] | None:
    if not value.isdigit() or int(value) < 1:
        return f"OMP_NUM_THREADS={value!r} is not a positive integer", "export OMP_NUM_THREADS=1"
    total = int(value) * f.local_ranks
    if total > f.cpu_count:
        return (
            f"{value} threads x {f.local_ranks} local ranks = {total} threads on "
            f"{f.cpu_count} cores: oversubscribed (ranks slow each other down)",
            f"export OMP_NUM_THREADS={max(f.cpu_count // max(f.local_ranks, 1), 1)}",
        )
    return None


def _problem(f: EnvFacts, name: str, value: str) -> tuple[str, str] | None:
    """(problem, fix) when the value is wrong or harmful."""
    rules: dict[str, Callable[[], tuple[str, str] | None]] = {
        "MASTER_PORT": lambda: _port(value),
        "OMP_NUM_THREADS": lambda: _threads(f, value),
        "GLOO_SOCKET_IFNAME": lambda: _ifnames(f, value, prefix_match=False),
        "NCCL_SOCKET_IFNAME": lambda: _ifnames(f, value, prefix_match=True),
        "CUDA_VISIBLE_DEVICES": lambda: (
            ("CUDA_VISIBLE_DEVICES is empty: no GPU is visible", "unset it or list GPU ids")
            if value.strip() == ""
            else None
        ),
        "NCCL_DEBUG": lambda: (
            None
            if value.upper() in {"VERSION", "WARN", "INFO", "TRACE", "ABORT"}
            else (f"NCCL_DEBUG={value!r} is not a level", "use WARN or INFO")
        ),
    }
    rule = rules.get(name)
    return rule() if rule else None


def _harmful(name: str, value: str) -> str | None:
    """A note when a valid value costs speed or hides failures."""
    v = value.strip().upper()
    notes = {
        ("NCCL_IB_DISABLE", "1"): "cross-node traffic uses TCP sockets (often 10x slower)",
        ("NCCL_P2P_DISABLE", "1"): "GPUs in this node exchange data through host memory",
        ("NCCL_SHM_DISABLE", "1"): "intra-node fallback transport disabled",
        ("CUDA_LAUNCH_BLOCKING", "1"): "every kernel launch waits: training is much slower",
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0"): "a failed collective no longer aborts: "
        "ranks hang instead of failing",
        ("TORCH_DISTRIBUTED_DEBUG", "DETAIL"): "extra checks on every collective slow training",
        ("TORCH_NCCL_ENABLE_MONITORING", "0"): "a rank whose watchdog is stuck is never killed",
    }
    if name in ("NCCL_BLOCKING_WAIT", "NCCL_ASYNC_ERROR_HANDLING"):
        return f"deprecated name: torch reads TORCH_{name} first and warns about this one"
    return notes.get((name, v))


def check_variable(f: EnvFacts, name: str, value: str) -> Check:
    doc = DOCS.get(name) or (
        "NCCL tuning/debug variable: overrides NCCL's own choice"
        if name.startswith("NCCL_")
        else "torch distributed setting"
    )
    label = f"env {name}"
    problem = _problem(f, name, value)
    if problem:
        return fail(label, f"{problem[0]} ({doc})", problem[1])
    note = _harmful(name, value)
    if note:
        return warn(label, f"{name}={value}: {note} ({doc})", f"unset {name} unless you need it")
    return ok(label, f"{name}={value}: {doc}")


def check_environ(f: EnvFacts) -> list[Check]:
    """One check per relevant variable that is set; hints for important unset ones."""
    checks = [check_variable(f, name, value) for name, value in sorted(f.environ.items())]
    if f.gpus and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in f.environ:
        checks.append(
            ok(
                "env flight recorder",
                "TORCH_NCCL_TRACE_BUFFER_SIZE is not set: the NCCL Flight Recorder is off, "
                "so a hang leaves no record of the last collectives (fsdpkit train turns it "
                "on for its workers and dumps it into RUN_DIR/hang)",
                "for other launchers, export TORCH_NCCL_TRACE_BUFFER_SIZE=2000 "
                "TORCH_NCCL_DUMP_ON_TIMEOUT=1 to get a per-rank dump on a collective timeout",
            )
        )
    if not f.environ:
        checks.append(ok("env", "no distributed/NCCL/gloo variables set: defaults apply"))
    return checks
