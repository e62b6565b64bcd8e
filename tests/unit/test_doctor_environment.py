"""Every environment check of ``fsdpkit doctor`` fails (or warns) on purpose with
injected facts: no GPU, /dev/shm size or bad variable is needed on this machine."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fsdpkit.doctor import environment as env
from fsdpkit.doctor.check import Check
from fsdpkit.doctor.envvars import check_environ, check_variable
from fsdpkit.doctor.facts import EnvFacts, GpuInfo, relevant_environ

GiB, MiB = 1024**3, 1024**2
H100 = GpuInfo(0, "NVIDIA H100 80GB HBM3", 80 * GiB, 79 * GiB, (9, 0), True)
V100 = GpuInfo(1, "Tesla V100-SXM2-32GB", 32 * GiB, 31 * GiB, (7, 0), False)
HEALTHY = EnvFacts(
    torch_version="2.13.0+cu128",
    fsdpkit_version="0.1.0",
    python_version="3.11.7",
    cuda_version="12.8",
    nccl=True,
    nccl_version="2.27.3",
    gpus=tuple(replace(H100, index=i) for i in range(8)),
    os_gpu_devices=8,
    cpu_count=96,
    interfaces=("lo", "eth0", "ib0"),
    shm_bytes=64 * GiB,
    nofile=(1048576, 1048576),
    disk_free=500 * GiB,
    local_ranks=8,
)


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def test_a_healthy_gpu_node_passes_every_check() -> None:
    checks = env.environment_checks(HEALTHY, checkpoint_bytes=100 * GiB)
    assert [c for c in checks if c.status in ("fail", "warn")] == []
    names = by_name(checks)
    assert names["gpus"].message.startswith("8 x NVIDIA H100")
    assert names["backends"].message == "gloo, NCCL 2.27.3"
    assert "Flight Recorder is off" in names["env flight recorder"].message
    assert names["clock skew"].status == "skip" and "not checkable" in names["clock skew"].message


@pytest.mark.parametrize(
    ("change", "name", "status", "words"),
    [
        ({"torch_version": "2.4.1+cu121"}, "torch", "fail", "needs torch >= 2.13"),
        (
            {"cuda_version": None},
            "torch",
            "fail",
            "(CPU-only build), Python 3.11.7, but this machine has 8 GPU",
        ),
        ({"fsdp2_error": "ImportError: no fully_shard"}, "fsdp2", "fail", "not importable"),
        ({"distributed": False}, "fsdp2", "fail", "torch.distributed is not available"),
        ({"dcp_error": "AttributeError: async_save"}, "dcp", "fail", "incomplete"),
        ({"gloo": False}, "backends", "fail", "gloo is not available"),
        ({"nccl": False}, "backends", "fail", "NCCL is not in this torch build"),
        ({"gpus": (H100, replace(V100, index=1))}, "gpus", "warn", "mixed GPU models"),
        ({"gpus": (replace(H100, free_bytes=30 * GiB),)}, "gpus", "warn", "GPU 0: 50.0 GiB"),
        ({"gpus": ()}, "gpus", "skip", "although the OS shows 8 GPU"),
        ({"gpus": (H100, V100)}, "bf16", "warn", "GPU(s) [1] have no bf16"),
        ({"p2p_missing": ((0, 1), (1, 0))}, "p2p", "warn", "0->1, 1->0"),
        ({"shm_bytes": 64 * MiB}, "shm", "fail", "/dev/shm is 64 MiB"),
        ({"shm_bytes": 512 * MiB}, "shm", "warn", "tight for NCCL with 8 GPUs"),
        ({"shm_bytes": None}, "shm", "warn", "/dev/shm is missing"),
        ({"nofile": (256, 4096)}, "open files", "fail", "open-file limit 256"),
        ({"nofile": (2048, 2048)}, "open files", "warn", "may run out"),
        ({"disk_free": 50 * GiB}, "disk", "fail", "but checkpoints need 100.0 GiB"),
        ({"disk_free": 150 * GiB}, "disk", "warn", "less than 2x headroom"),
    ],
)
def test_each_environment_check_fails_on_purpose(
    change: dict[str, object], name: str, status: str, words: str
) -> None:
    checks = by_name(env.environment_checks(replace(HEALTHY, **change), checkpoint_bytes=100 * GiB))
    assert checks[name].status == status, checks[name]
    assert words in checks[name].message
    if status in ("fail", "warn"):
        assert checks[name].fix, "every problem says what to do"


def test_bf16_verdict_follows_the_configured_precision() -> None:
    old = replace(HEALTHY, gpus=(V100,))
    assert env.check_bf16(old, precision="bf16").status == "fail"
    assert env.check_bf16(old, precision="auto").status == "warn"
    cpu = replace(HEALTHY, gpus=(), cpu_bf16_slowdown=86.0)
    slow = env.check_bf16(cpu, precision="bf16")
    assert slow.status == "warn" and "86.0x the fp32 time" in slow.message
    assert env.check_bf16(cpu, precision="fp32").status == "skip"
    cpu_gloo = by_name(env.environment_checks(replace(cpu, shm_bytes=64 * MiB, nccl=False)))
    assert cpu_gloo["shm"].status == "warn"  # gloo itself does not use /dev/shm
    assert cpu_gloo["p2p"].status == "skip" and cpu_gloo["backends"].status == "ok"


@pytest.mark.parametrize(
    ("name", "value", "status", "words"),
    [
        ("MASTER_PORT", "0", "fail", "cannot agree on a port"),
        ("MASTER_PORT", "http", "fail", "not a port number"),
        ("MASTER_PORT", "70000", "fail", "above 65535"),
        ("MASTER_PORT", "29500", "ok", "rank 0's rendezvous store"),
        ("GLOO_SOCKET_IFNAME", "eth1", "fail", "no interface named eth1"),
        ("GLOO_SOCKET_IFNAME", "eth0", "ok", "gloo binds to"),
        ("NCCL_SOCKET_IFNAME", "^docker,eth", "ok", "prefix match"),
        ("NCCL_SOCKET_IFNAME", "=eth", "fail", "no interface named eth"),
        ("OMP_NUM_THREADS", "24", "fail", "oversubscribed"),
        ("OMP_NUM_THREADS", "zero", "fail", "not a positive integer"),
        ("NCCL_IB_DISABLE", "1", "warn", "TCP sockets"),
        ("NCCL_P2P_DISABLE", "1", "warn", "through host memory"),
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0", "warn", "hang instead of failing"),
        ("NCCL_ASYNC_ERROR_HANDLING", "1", "warn", "deprecated name"),
        ("NCCL_DEBUG", "LOUD", "fail", "not a level"),
        ("CUDA_VISIBLE_DEVICES", "", "fail", "no GPU is visible"),
        ("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000", "ok", "Flight Recorder"),
        ("NCCL_NCHANNELS_PER_NET_PEER", "4", "ok", "overrides NCCL's own choice"),
    ],
)
def test_environment_variables_are_explained_and_judged(
    name: str, value: str, status: str, words: str
) -> None:
    check = check_variable(HEALTHY, name, value)
    assert (check.status, check.name) == (status, f"env {name}")
    assert words in check.message + check.fix


def test_only_relevant_variables_are_read() -> None:
    seen = relevant_environ(
        {"HOME": "/root", "NCCL_DEBUG": "INFO", "MASTER_ADDR": "n0", "PATH": "x"}
    )
    assert seen == {"MASTER_ADDR": "n0", "NCCL_DEBUG": "INFO"}
    lines = check_environ(replace(HEALTHY, environ=seen, gpus=()))
    assert [c.name for c in lines] == ["env MASTER_ADDR", "env NCCL_DEBUG"]


def test_compile_needs_inductors_compiler_where_the_run_runs() -> None:
    cpu = {"gpu": False, "cxx_name": "g++", "cxx": None, "triton": False}
    assert env.check_compile(compile_blocks=False, **cpu).status == "skip"
    missing = env.check_compile(compile_blocks=True, **cpu)
    assert missing.status == "fail" and "C++ compiler (g++) is not on PATH" in missing.message
    assert "train.compile = false" in missing.fix
    found = env.check_compile(compile_blocks=True, **{**cpu, "cxx": "/usr/bin/g++"})
    assert found.status == "ok" and "/usr/bin/g++" in found.message
    gpu = {**cpu, "gpu": True}
    no_triton = env.check_compile(compile_blocks=True, **gpu)
    assert no_triton.status == "fail" and "Triton" in no_triton.message
    assert env.check_compile(compile_blocks=True, **{**gpu, "triton": True}).status == "ok"
    facts = replace(HEALTHY, gpus=(), cxx_name="g++", cxx=None)
    assert by_name(env.environment_checks(facts, compile_blocks=True))["compile"].status == "fail"
