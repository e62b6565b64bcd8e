"""Accelerate's ``parallelism_config`` -> fsdpkit's mesh: ``parallel.strategy``,
``shard_degree``, ``tp`` and ``cp``.

Accelerate (1.x, ``accelerate/parallelism_config.py``; ``accelerate config`` writes the
section for FSDP2) builds one DeviceMesh of (dp_replicate, dp_shard, cp, tp), tp
fastest, and requires their product to equal num_processes; FSDP2 shards over
dp_shard x cp. fsdpkit's mesh is the same ([Note: parallel dimensions] in
fsdpkit.config.dims), so the sizes carry over one to one:

- ``tp_size`` -> ``parallel.tp`` (Accelerate applies the model's ``tp_plan``; fsdpkit
  its plan for the built-in Llama or the transformers model's ``base_model_tp_plan``);
- ``cp_size`` -> ``parallel.cp``; fsdpkit exchanges heads for sequence with all-to-alls
  (Ulysses), where Accelerate's default ``cp_backend: torch`` runs torch's ring
  attention: the same split of every activation, another exchange;
- ``sp_size`` (``sp_backend: deepspeed``, ALST / Ulysses) -> ``parallel.cp`` too: it is
  the same all-to-all sequence parallelism;
- ``dp_replicate_size`` x ``dp_shard_size``: HSDP (``hybrid``, ``shard_degree`` =
  dp_shard) with replicas, DDP-like ``replicate`` when dp_shard is 1, else FSDP's
  ``full`` over the data-parallel ranks (shard_degree is only a hybrid setting).
"""

from __future__ import annotations

from typing import Any

from fsdpkit.migrate.outcome import MigrateError, Migration

SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")
IGNORED = {
    "cp_comm_strategy": "fsdpkit's context parallelism always exchanges with all-to-alls",
    "sp_seq_length": "fsdpkit splits data.seq_len, whatever the batch",
    "sp_seq_length_is_variable": "fsdpkit's sequences have the fixed data.seq_len",
    "sp_attn_implementation": "fsdpkit's attention is SDPA",
}


def _sizes(cfg: dict[str, Any]) -> dict[str, int]:
    out = {}
    for name in SIZES:
        raw = cfg.get(name)
        try:
            out[name] = int(raw) if raw is not None else 1
        except (TypeError, ValueError):
            raise MigrateError(
                f"parallelism_config_{name} = {raw!r} is not an integer; set it to the "
                "number of ranks of that axis (1 for none)."
            ) from None
        if out[name] < 1:
            raise MigrateError(f"parallelism_config_{name} = {raw!r} must be >= 1.")
    return out


def _check_total(sizes: dict[str, int], *, procs: int) -> None:
    """Accelerate refuses a mesh whose product is not num_processes: so does migrate."""
    total = 1
    for n in sizes.values():
        total *= n
    if procs > 0 and total > 1 and total != procs:
        product = " x ".join(f"{k.removesuffix('_size')} {v}" for k, v in sizes.items() if v > 1)
        raise MigrateError(
            f"parallelism_config: {product} = {total} ranks, but num_processes is {procs}; "
            "Accelerate refuses such a config too (ParallelismConfig total_size must match "
            "num_processes). Fix the sizes or num_processes."
        )


def convert_parallelism(m: Migration, data: dict[str, Any]) -> None:
    """Set the fsdpkit mesh keys from ``data['parallelism_config']`` (see the module
    docstring); keys with or without the ``parallelism_config_`` prefix."""
    raw = data.get("parallelism_config") or {}
    if not isinstance(raw, dict):
        raise MigrateError("parallelism_config must be a mapping of parallelism_config_* keys.")
    cfg = {k.removeprefix("parallelism_config_"): v for k, v in raw.items()}
    sizes = _sizes(cfg)
    _check_total(sizes, procs=int(data.get("num_processes") or 0))
    _data_parallel(m, replicate=sizes["dp_replicate_size"], shard=sizes["dp_shard_size"])
    _model_parallel(m, sizes, cfg, data)
    for name, why in IGNORED.items():
        if name in cfg and (name != "cp_comm_strategy" or sizes["cp_size"] > 1):
            m.drop(f"parallelism_config_{name}: {cfg[name]}", why)


def _data_parallel(m: Migration, *, replicate: int, shard: int) -> None:
    if replicate == 1:
        return
    src = f"parallelism_config_dp_replicate_size: {replicate}"
    if shard == 1:
        m.set("parallel.strategy", "replicate", src, "every data-parallel rank holds the model")
        return
    base = next((s for s in m.settings if s.key == "parallel.strategy"), None)
    keeps = base is not None and base.value in ("grad_op", "hybrid_grad_op")
    m.set(
        "parallel.strategy",
        "hybrid_grad_op" if keeps else "hybrid",
        src + (f" with {base.source}" if base is not None else ""),
        f"{replicate} replicas of a shard group (HSDP)",
    )
    m.set("parallel.shard_degree", shard, f"parallelism_config_dp_shard_size: {shard}")


def _model_parallel(
    m: Migration, sizes: dict[str, int], cfg: dict[str, Any], data: dict[str, Any]
) -> None:
    tp, cp, sp = sizes["tp_size"], sizes["cp_size"], sizes["sp_size"]
    if tp > 1:
        m.set(
            "parallel.tp", tp, f"parallelism_config_tp_size: {tp}",
            "fsdpkit splits the built-in Llama (with sequence parallelism) or a transformers "
            "model by its base_model_tp_plan; tp stays inside a node",
        )  # fmt: skip
        _check_node(m, tp=tp, data=data)
    if cp > 1 and sp > 1:
        raise MigrateError(
            f"parallelism_config_cp_size = {cp} and parallelism_config_sp_size = {sp}: fsdpkit "
            "has one sequence axis (parallel.cp, an all-to-all exchange like ALST's). Keep one "
            "of them, or set cp_size to their product."
        )
    if cp > 1:
        backend = str(cfg.get("cp_backend", "torch"))
        note = "Ulysses all-to-all exchange of heads for sequence"
        if backend != "deepspeed":
            note += f" (Accelerate's cp_backend {backend} runs ring attention instead)"
        m.set("parallel.cp", cp, f"parallelism_config_cp_size: {cp}", note)
    elif sp > 1:
        m.set(
            "parallel.cp", sp, f"parallelism_config_sp_size: {sp}",
            "the same all-to-all sequence parallelism as ALST / Ulysses, as parallel.cp",
        )  # fmt: skip


def _check_node(m: Migration, *, tp: int, data: dict[str, Any]) -> None:
    """fsdpkit keeps a tensor-parallel group inside a node; say so before a launch fails."""
    machines = int(data.get("num_machines") or 1)
    procs = int(data.get("num_processes") or 0)
    per_node = procs // machines if procs else 0
    if per_node and per_node % tp:
        m.warnings.append(
            f"parallelism_config_tp_size = {tp} does not divide the {per_node} processes per "
            "node: fsdpkit refuses parallel.tp across nodes (set num_processes or tp so that "
            "tp divides the ranks of one machine)"
        )
