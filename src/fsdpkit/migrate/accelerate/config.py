"""Accelerate config (``accelerate config`` YAML or JSON) -> fsdpkit settings.

Key names are Accelerate's (``accelerate/commands/config/cluster.py``,
``FullyShardedDataParallelPlugin``): ``fsdp_config`` entries with or without the
``fsdp_`` prefix (the launcher adds it), FSDP1 (``fsdp_version: 1``, the default) and
FSDP2 semantics. Unknown top-level keys are an error, as Accelerate itself refuses
them; unknown ``fsdp_config`` keys, which Accelerate silently ignores, become warnings.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from fsdpkit.migrate import fsdp1_args as fsdp1
from fsdpkit.migrate.accelerate.fsdp import convert_fsdp_section, note_conflict
from fsdpkit.migrate.accelerate.parallelism import convert_parallelism
from fsdpkit.migrate.outcome import MigrateError, Migration

TOP_LEVEL = {
    "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug",
    "num_processes", "machine_rank", "num_machines", "gpu_ids", "main_process_ip",
    "main_process_port", "rdzv_backend", "same_network", "main_training_function",
    "enable_cpu_affinity", "fp8_config", "deepspeed_config", "fsdp_config",
    "parallelism_config", "megatron_lm_config", "mpirun_config", "ipex_config",
    "downcast_bf16", "tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo",
    "command_file", "commands", "tpu_vm", "tpu_env", "dynamo_config", "dynamo_backend", "fp16",
}  # fmt: skip


def read_file(path: Path) -> dict[str, Any]:
    """A YAML (or JSON) mapping; errors name the file."""
    if not path.is_file():
        raise MigrateError(f"{path} does not exist. Pass the Accelerate config file to convert.")
    text = path.read_text()
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise MigrateError(f"{path} is not valid JSON: {exc}") from None
    else:
        try:
            import yaml
        except ImportError:
            raise MigrateError(
                "reading Accelerate's YAML needs PyYAML: pip install 'fsdpkit[migrate]'"
            ) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise MigrateError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise MigrateError(f"{path} does not hold a mapping of Accelerate settings.")
    return data


def _check_top_level(data: dict[str, Any], source: str) -> None:
    unknown = sorted(set(data) - TOP_LEVEL)
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, sorted(TOP_LEVEL), n=1, cutoff=0.6)
            hints.append(f"{key} (did you mean {close[0]}?)" if close else key)
        raise MigrateError(
            f"{source} has unknown Accelerate keys: {', '.join(hints)}. Accelerate refuses "
            "such a file too; fix or remove them."
        )


def _normalized_fsdp(data: dict[str, Any], source: str) -> dict[str, Any]:
    fsdp = data.get("fsdp_config")
    if not fsdp:
        kind = data.get("distributed_type", "not set")
        raise MigrateError(
            f"{source} has no fsdp_config section (distributed_type: {kind}), so it does not "
            "use FSDP: nothing to convert. For DDP-like training set parallel.strategy = "
            '"replicate" in an fsdpkit config.'
        )
    if not isinstance(fsdp, dict):
        raise MigrateError(f"{source}: fsdp_config must be a mapping of fsdp_* keys.")
    return {k if k.startswith("fsdp_") else f"fsdp_{k}": v for k, v in fsdp.items()}


_PRECISION = {
    "no": ("fp32", ""),
    "fp32": ("fp32", ""),
    "bf16": (
        "bf16",
        "meaning changed: Accelerate autocasts the forward to bf16 around fp32 parameters; "
        "fsdpkit's bf16 gathers bf16 parameter copies for compute and reduces gradients in "
        "fp32 (fp32 master weights either way)",
    ),
    "fp16": (
        "fp16",
        "fp16 compute with a sharded dynamic loss scaler (as Accelerate's GradScaler)",
    ),
    "fp8": (
        "bf16",
        "no fp8 in fsdpkit: bf16 is the closest (Accelerate ran fp8 matmuls inside bf16 autocast)",
    ),
}


def _precision(m: Migration, data: dict[str, Any]) -> None:
    if "mixed_precision" in data:
        raw, key = data["mixed_precision"], "mixed_precision"
    elif "fp16" in data:  # Accelerate < 0.10 wrote fp16: true
        raw, key = data["fp16"], "fp16"
    else:
        return
    value = "no" if raw is None else str(raw).lower()
    if key == "fp16":
        value = "fp16" if fsdp1.boolean(raw, key="fp16") else "no"
    if value not in _PRECISION:
        raise MigrateError(f"mixed_precision = {raw!r} is not one of {', '.join(_PRECISION)}.")
    mode, note = _PRECISION[value]
    m.set("precision.mode", mode, f"{key}: {raw}", note)
    downcast = data.get("downcast_bf16")
    if str(downcast).lower() not in ("none", "no", "false", "0", ""):
        m.drop(f"downcast_bf16: {downcast}", "TPU-only setting; no equivalent")


def _launch(m: Migration, data: dict[str, Any], config_name: str) -> None:
    """Accelerate's process layout as an fsdpkit train command line."""
    machines = int(data.get("num_machines") or 1)
    procs = int(data.get("num_processes") or 0)
    parts = [f"fsdpkit train {config_name}"]
    if procs > 0:
        if procs % machines:
            m.warnings.append(
                f"num_processes {procs} is not a multiple of num_machines {machines}; "
                "fsdpkit runs the same number of ranks on every node"
            )
        parts.append(f"--nproc {max(procs // machines, 1)}")
    if machines > 1:
        ip, port = data.get("main_process_ip", "NODE0"), data.get("main_process_port", 29500)
        parts.append(f"--nnodes {machines} --rdzv-endpoint {ip}:{port}")
        if str(data.get("rdzv_backend", "static")) == "static":
            parts.append(f"--node-rank {data.get('machine_rank', 0)}")
    gpu_ids = data.get("gpu_ids")
    prefix = f"CUDA_VISIBLE_DEVICES={gpu_ids} " if gpu_ids not in (None, "all", "") else ""
    m.launch = prefix + " ".join(parts)
    if data.get("use_cpu"):
        m.drop("use_cpu: true", "fsdpkit trains on the CPU with gloo whenever no GPU is visible")


def _others(m: Migration, data: dict[str, Any]) -> None:
    kind = str(data.get("distributed_type", "FSDP"))
    if kind != "FSDP":
        note_conflict(
            m,
            f"distributed_type is {kind}, so Accelerate would not use FSDP and ignores "
            "fsdp_config; converted the fsdp_config anyway",
        )
    if data.get("deepspeed_config"):
        m.drop("deepspeed_config", "DeepSpeed settings are not converted")
        note_conflict(
            m, "the file has both deepspeed_config and fsdp_config; only FSDP is converted"
        )
    _dynamo(m, data)
    if data.get("fp8_config"):
        m.drop("fp8_config", "no fp8 in fsdpkit")


def _dynamo(m: Migration, data: dict[str, Any]) -> None:
    """Accelerate's torch.compile settings: the inductor backend becomes train.compile
    (fsdpkit compiles each block before sharding, as torchtitan does); other backends
    and dynamo's options have no equivalent."""
    dynamo = dict(data.get("dynamo_config") or {})
    if data.get("dynamo_backend") not in (None, "NO"):
        dynamo = {"dynamo_backend": data["dynamo_backend"]}
    backend = str(dynamo.pop("dynamo_backend", "NO")).upper()
    if backend == "INDUCTOR":
        m.set(
            "train.compile",
            True,
            "dynamo_config.dynamo_backend: INDUCTOR",
            "torch.compile per block before sharding (not the whole model)",
        )
    elif backend != "NO":
        m.drop(f"dynamo_backend: {backend}", "fsdpkit compiles with inductor only")
    if dynamo:
        m.drop(f"dynamo_config: {dynamo}", "dynamo options are not converted")


def convert_accelerate(path: str | Path, *, output_name: str = "run.toml") -> Migration:
    """Read an Accelerate config and collect the fsdpkit settings it implies."""
    path = Path(path)
    data = read_file(path)
    _check_top_level(data, str(path))
    fsdp = _normalized_fsdp(data, str(path))
    m = Migration(origin=f"{path.name} (Accelerate, FSDP{fsdp.get('fsdp_version', 1)})")
    _precision(m, data)
    convert_fsdp_section(m, fsdp)
    convert_parallelism(m, data)
    _others(m, data)
    _launch(m, data, output_name)
    return m
