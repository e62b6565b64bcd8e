"""The in-process sections of bench/gpu_check.py (one NCCL group of 1 rank), and the
helpers both files use. Run bench/gpu_check.py, not this file (run once, on one H200:
bench/results/gpu_check.json).
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # support.train / train_mixed: the parity loops

from fsdpkit.config import RunConfig, load  # noqa: E402
from fsdpkit.devices import Device, detected_device  # noqa: E402
from fsdpkit.planner import plan  # noqa: E402

GiB = 1024**3


@dataclass
class Row:
    section: str
    claim: str
    measured: str
    ok: bool | None
    """None: measured for the record, no pass/fail bound."""


# -- helpers ----------------------------------------------------------------------


def listeners(pids: list[int]) -> list[str]:
    """``addr:port`` of every TCP socket in LISTEN state owned by ``pids``
    (/proc/PID/fd inodes matched against /proc/net/tcp and tcp6)."""
    inodes: set[str] = set()
    for pid in pids:
        with_fds = Path(f"/proc/{pid}/fd")
        for fd in with_fds.iterdir() if with_fds.exists() else []:
            target = os.readlink(fd) if fd.is_symlink() else ""
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                out.append(_address(cols[1]))
    return out


def _address(hexaddr: str) -> str:
    host, port = hexaddr.split(":")
    if len(host) == 8:  # IPv4, little-endian
        ip = ".".join(str(int(host[i : i + 2], 16)) for i in (6, 4, 2, 0))
    else:
        ip = "::1" if host == "0" * 24 + "01000000" else f"v6:{host}"
    return f"{ip}:{int(port, 16)}"


def all_loopback(addrs: list[str]) -> bool:
    return all(a.startswith(("127.", "::1:")) for a in addrs)


def bf16_config(*overrides: str) -> RunConfig:
    return load(None, ["precision.mode=bf16", *overrides])


def _small_model(cfg: RunConfig) -> torch.nn.Module:
    """The run's Llama on meta, sharded on a 1-rank cuda mesh by ``shard()``."""
    from fsdpkit.models.llama import Llama
    from fsdpkit.planner.shapes.scenario import model_shape
    from fsdpkit.sharding import shard
    from fsdpkit.sharding.mesh import build_mesh

    with torch.device("meta"):
        model = Llama(model_shape(cfg))
    shard(model, cfg, mesh=build_mesh(device_type="cuda"))
    return model


def _tokens(cfg: RunConfig, n: int) -> list[torch.Tensor]:
    size = (cfg.train.micro_batch_size, cfg.data.seq_len + 1)
    from fsdpkit.planner.shapes.scenario import model_shape

    vocab = model_shape(cfg).vocab_size
    return [torch.randint(0, vocab, size, device="cuda") for _ in range(n)]


# -- sections that run in this process (NCCL group of 1) ------------------------


def check_device() -> list[Row]:
    from fsdpkit.config import PrecisionConfig
    from fsdpkit.sharding.mesh import build_mesh
    from fsdpkit.sharding.policy import resolve_precision

    auto = resolve_precision(PrecisionConfig(mode="auto"), device_type="cuda").name
    dev = detected_device()
    mesh = build_mesh()
    return [
        Row("device", "precision.mode=auto is bf16 on a bf16 GPU", auto, auto == "bf16"),
        Row("device", "the GPU is in the device table (MFU peak)",
            f"{torch.cuda.get_device_name()} -> {dev and dev.name}, "
            f"{dev and dev.tflops} TFLOP/s bf16", dev is not None and dev.name != "gpu"),
        Row("device", "build_mesh() on a GPU machine is cuda", mesh.device_type,
            mesh.device_type == "cuda"),
        Row("device", "the process group is NCCL", str(dist.get_backend()),
            dist.get_backend() == "nccl"),
    ]  # fmt: skip


def check_nccl() -> list[Row]:
    x = torch.ones(16 * 2**20, device="cuda")  # 64 MiB
    dist.all_reduce(x)
    torch.cuda.synchronize()
    addrs = listeners([os.getpid()])
    env = os.environ.get("NCCL_SOCKET_IFNAME")
    return [
        Row("nccl", "NCCL all-reduce of 64 MiB (1 rank)", f"sum {float(x[0])}", float(x[0]) == 1),
        Row("nccl", f"listeners bind to loopback (NCCL_SOCKET_IFNAME={env})",
            ", ".join(addrs) or "no listener", all_loopback(addrs) if addrs else None),
    ]  # fmt: skip


def check_parity() -> list[Row]:
    """1-rank FSDP2 bf16 vs support.train_mixed on an 8-layer d=512 Llama, 5 steps."""
    from fsdpkit.models.llama import preset
    from fsdpkit.sharding import shard
    from fsdpkit.sharding.mesh import build_mesh
    from support import build, full_state, global_batches, train, train_mixed

    shape = preset("tiny", dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1376)
    batches = global_batches(5, vocab=shape.vocab_size).to("cuda")
    ref_model = build(shape).to("cuda")
    ref = train_mixed(ref_model, batches, dp=1, param_dtype=torch.bfloat16, clip=0.0)
    model = build(shape).to("cuda")
    shard(model, bf16_config(), mesh=build_mesh(device_type="cuda"))
    got = train(model, batches, clip=0.0)
    loss = max(abs(a - b) / abs(b) for a, b in zip(got["loss"], ref["loss"]))
    norm = max(abs(a - b) / abs(b) for a, b in zip(got["norm"], ref["norm"]))
    want, have = full_state(ref_model), full_state(model)
    param = max(float((have[k] - v).abs().max()) for k, v in want.items())
    text = f"loss {loss:.1e}, grad norm {norm:.1e}, params max |diff| {param:.1e}"
    return [Row("parity", "1-rank FSDP2 bf16 = unsharded bf16/fp32-reduce (<= 1e-5)", text,
                max(loss, norm, param) <= 1e-5)]  # fmt: skip


def check_adamw() -> list[Row]:
    from fsdpkit.trainable.optim import build_optimizer, param_device_type, resolve_impl

    cfg = bf16_config("model.preset=llama3-1b", "data.seq_len=1024", "train.micro_batch_size=1")
    model = _small_model(cfg)
    params = list(model.parameters())
    impl = resolve_impl(cfg.train.optimizer_impl, device_type=param_device_type(params))
    opt = build_optimizer(model, cfg.train)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    seconds = {}
    for name in ("fused", "foreach"):
        trial = torch.optim.AdamW(params, lr=1e-4, **{name: True})
        trial.step()  # states
        torch.cuda.synchronize()
        start = time.perf_counter()
        trial.step()
        torch.cuda.synchronize()
        seconds[name] = time.perf_counter() - start
    opt.step()
    fused = bool(opt.defaults.get("fused"))
    return [
        Row("adamw", "optimizer_impl=auto is fused on CUDA shards", f"{impl}, fused={fused}",
            impl == "fused" and fused),
        Row("adamw", "AdamW step on 1.2B sharded params (1 rank)",
            f"fused {seconds['fused'] * 1e3:.1f} ms, foreach {seconds['foreach'] * 1e3:.1f} ms",
            None),
    ]  # fmt: skip


def check_staging() -> list[Row]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from fsdpkit.checkpoint.staging import Stager

    model = _small_model(bf16_config("model.preset=llama3-1b"))
    state = get_model_state_dict(model)
    stager = Stager()
    stager.stage(state)  # allocates
    start = time.perf_counter()
    staged = stager.stage(state)
    seconds = time.perf_counter() - start
    bufs = [v.to_local() if hasattr(v, "to_local") else v for v in staged.values()]
    pinned = all(b.is_pinned() for b in bufs if isinstance(b, torch.Tensor))
    key = next(iter(state))
    src = state[key].to_local() if hasattr(state[key], "to_local") else state[key]
    same = torch.equal(src.cpu(), bufs[0])
    gbps = stager.nbytes / seconds / 1e9
    return [Row("staging", "async-save staging buffers pinned on CUDA, reused",
                f"pinned={pinned}, equal={same}, allocations={stager.allocations}, "
                f"{stager.nbytes / GiB:.2f} GiB at {gbps:.1f} GB/s",
                pinned and same and stager.allocations == 1)]  # fmt: skip


def check_offload() -> list[Row]:
    from fsdpkit.trainable.optim import build_optimizer
    from fsdpkit.trainable.step import train_step

    cfg = bf16_config("model.preset=llama3-1b", "model.n_layers=4", "data.seq_len=1024",
                  "train.micro_batch_size=1", "offload.params=true")  # fmt: skip
    model = _small_model(cfg)
    local = [p.to_local() for p in model.parameters()]
    where = {t.device.type for t in local}
    pinned = all(t.is_pinned() for t in local)
    opt = build_optimizer(model, cfg.train)
    result = train_step(model, opt, _tokens(cfg, 1), loss_fn=_loss(model, cfg), max_norm=1.0)
    return [Row("offload", "offload.params shards on the host, pinned, and a step runs",
                f"devices={sorted(where)}, pinned={pinned}, loss {float(result.loss):.3f}",
                where == {"cpu"} and pinned)]  # fmt: skip


def _loss(model: torch.nn.Module, cfg: RunConfig) -> Callable[..., torch.Tensor]:
    from fsdpkit.loss.contract import next_token_loss
    from fsdpkit.loss.head import choose_loss

    kw = {"mode": cfg.train.chunked_loss, "chunk_tokens": cfg.train.loss_chunk_tokens}
    return choose_loss(model, **kw, default=next_token_loss, custom_loss=False).loss_fn


def check_compile() -> list[Row]:
    from fsdpkit.sharding.compile import compile_seconds
    from fsdpkit.trainable.optim import build_optimizer
    from fsdpkit.trainable.step import train_step

    out: dict[str, list[float]] = {}
    for flag in ("false", "true"):
        cfg = bf16_config("model.preset=llama3-1b", "model.n_layers=4", "data.seq_len=2048",
                      "train.micro_batch_size=2", f"train.compile={flag}")  # fmt: skip
        torch.manual_seed(0)
        batches = _tokens(cfg, 1)  # the same tokens for both
        model = _small_model(cfg)
        opt, loss_fn = build_optimizer(model, cfg.train), _loss(model, cfg)
        times, losses = [], []
        for _ in range(4):
            start = time.perf_counter()
            losses.append(float(train_step(model, opt, batches, loss_fn=loss_fn, max_norm=1).loss))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        out[flag] = [statistics.median(times[2:]), losses[0]]
    gap = abs(out["true"][1] - out["false"][1]) / out["false"][1]
    return [
        Row("compile", "train.compile on CUDA compiles and matches eager (first loss, 1e-2)",
            f"compile {compile_seconds():.0f} s, first-loss gap {gap:.1e}",
            compile_seconds() > 0 and gap <= 1e-2),
        Row("compile", "step time compiled / eager (llama3-1b, 4 layers, 2x2048)",
            f"{out['true'][0] / out['false'][0]:.2f}x", None),
    ]  # fmt: skip


PLAN_ROWS = {
    "1b AC full 1x2048": ("model.preset=llama3-1b", "data.seq_len=2048",
                          "train.micro_batch_size=1", "activations.mode=full"),
    "1b no AC 1x1024": ("model.preset=llama3-1b", "data.seq_len=1024", "train.micro_batch_size=1"),
    "1b AC full accum 2": ("model.preset=llama3-1b", "data.seq_len=2048",
                           "train.micro_batch_size=1", "train.grad_accum=2",
                           "activations.mode=full"),
    "1b 1x1024 full logits": ("model.preset=llama3-1b", "data.seq_len=1024",
                              "train.micro_batch_size=1", "train.chunked_loss=off"),
    "3b AC full 1x2048": ("model.preset=llama3-3b", "data.seq_len=2048",
                          "train.micro_batch_size=1", "activations.mode=full"),
}  # fmt: skip
"""docs/planner.md "GPU check": the analytic plan vs the measured steady-state peak."""


def measured_peak(cfg: RunConfig) -> tuple[int, int]:
    """Steady-state peak of allocated CUDA memory of the trainer's step, minus before,
    and the memory allocated before (non-zero: an earlier row's tensors still alive)."""
    from fsdpkit.trainable.optim import build_optimizer
    from fsdpkit.trainable.step import train_step

    gc.collect()  # an earlier row's model in a reference cycle would count as "before"
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    model = _small_model(cfg)
    opt = build_optimizer(model, cfg.train)
    batches = _tokens(cfg, cfg.train.grad_accum)
    kw = {"loss_fn": _loss(model, cfg), "max_norm": cfg.train.grad_clip}
    train_step(model, opt, batches, **kw)  # creates the AdamW states
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    train_step(model, opt, batches, **kw)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del model, opt, batches
    return peak, base


def planned(cfg: RunConfig, device: Device) -> int:
    return plan(cfg, world_size=1, device=device).memory.peak.bytes


def check_planner(device: Device | None = None) -> list[Row]:
    device = device or detected_device()
    assert device is not None
    rows = []
    for name, overrides in PLAN_ROWS.items():
        cfg = bf16_config(*overrides)
        predicted = planned(cfg, device)
        true, base = measured_peak(cfg)
        err = (predicted - true) / true
        rows.append(Row("planner", f"plan vs max_memory_allocated: {name} (10%)",
                        f"measured {true / GiB:.2f} GiB, plan {predicted / GiB:.2f} GiB, "
                        f"{err:+.1%} (before: {base / GiB:.2f} GiB)",
                        abs(err) <= 0.10))  # fmt: skip
    return rows


IN_PROCESS: dict[str, Callable[[], list[Row]]] = {
    "device": check_device, "nccl": check_nccl, "parity": check_parity, "adamw": check_adamw,
    "staging": check_staging, "offload": check_offload, "compile": check_compile,
    "planner": check_planner,
}  # fmt: skip
