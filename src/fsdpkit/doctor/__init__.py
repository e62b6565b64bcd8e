"""``fsdpkit doctor``: is this machine, this model and this cluster ready to train?

Modules, each owning one thing:
    check        the Check record (ok / warn / fail / skip, message, fix)
    facts        EnvFacts gathered from the machine (injectable in tests)
    environment  torch build, FSDP2/DCP, backends, GPUs, bf16, p2p, /dev/shm, limits, disk
    envvars      what each distributed environment variable does, and its verdict
    model        units shard() would build: root share, shared params, dtypes, balance
    buffer_check buffers meta-device init would leave uninitialized
    diagnose     model checks for a config: build, buffers, plan fit, fake-tensor dry run
    network      multi-node rendezvous, node info exchange, version agreement
    bandwidth    all-reduce benchmark on the local (and remote) ranks
    examine      run_doctor: everything the command asked for, tagged by section
    check_text   text and JSON formatting (no checks in there)
"""

from fsdpkit.doctor.check import Check, Status, counts, failed
from fsdpkit.doctor.check_text import format_report, report_dict
from fsdpkit.doctor.environment import environment_checks
from fsdpkit.doctor.examine import NetworkOptions, network_checks, run_doctor
from fsdpkit.doctor.facts import EnvFacts, GpuInfo, gather

__all__ = [
    "Check",
    "EnvFacts",
    "GpuInfo",
    "NetworkOptions",
    "Status",
    "counts",
    "environment_checks",
    "failed",
    "format_report",
    "gather",
    "network_checks",
    "report_dict",
    "run_doctor",
]
