"""Everything one rank needs to train, built in the order FSDP2 requires.

data (fsdpkit.data.open_training_data: prepared shards, mapped) -> model,
fine-tuning, loss, blocks (fsdpkit.trainable.build_unsharded) -> process group ->
mesh -> shard, weights, optimizer (fsdpkit.trainable.shard_trainable; [Note: one
builder]) -> scheduler -> scaler -> checkpointer.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fsdpkit.checkpoint import Checkpointer, ModelOptimizerState, RankLocal, RNGState
from fsdpkit.checkpoint.frozen import FrozenBase
from fsdpkit.config import BatchSplit, ParallelDims, RunConfig, batch_split, parallel_dims, to_toml
from fsdpkit.config.rl import check_grpo_batch
from fsdpkit.config.rl_rules import with_rl_context
from fsdpkit.data import Tokenizer, TrainingData, open_training_data
from fsdpkit.data.preference import open_preference_data
from fsdpkit.data.prompt_order import open_prompt_data
from fsdpkit.models.hf.directory import HF_RUN_DIR, copy_hf_files, with_model_tokenizer
from fsdpkit.models.llama import LlamaConfig
from fsdpkit.rollout.rewards import Rewards, build_rewards
from fsdpkit.runtime.distenv import DistEnv, pin_collectives, rendezvous_store
from fsdpkit.runtime.rundir import RunDirError, describe_os_error, write_text_atomically
from fsdpkit.sharding import make_grad_scaler
from fsdpkit.sharding.mesh import build_mesh
from fsdpkit.train.rl_build import build_rl
from fsdpkit.train.rl_build import check_lengths as check_rl_lengths
from fsdpkit.train.rl_build import describe as describe_rl
from fsdpkit.train.rl_step import RlRun
from fsdpkit.train.state import TrainerState
from fsdpkit.train.telemetry import MetricsWriter
from fsdpkit.trainable.build import Trainable, build_unsharded, shard_trainable
from fsdpkit.trainable.optim import build_scheduler
from fsdpkit.trainable.pipeline.preference import pipelined_dpo, shard_reference_stages
from fsdpkit.trainable.reference import DpoLoss, build_reference_unsharded, shard_reference
from fsdpkit.version import written_by


@dataclass
class Session:
    cfg: RunConfig
    env: DistEnv
    split: BatchSplit
    """This world size's micro-batches and accumulation ([Note: batch split])."""
    mesh: DeviceMesh
    device: torch.device
    run_dir: Path
    tokenizer: Tokenizer
    loader: Any
    """This rank's batches (fsdpkit.data.Loader: next_step(), state_dict())."""
    val: list[Any]
    """This rank's validation micro-batches (token ids, or SFTBatch for SFT data)."""
    trainable: Trainable
    """The sharded model, its loss and optimizer and what building them decided
    ([Note: one builder]); the session reads through it (``s.trainable.model``)."""
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler | None
    state: TrainerState
    checkpointer: Checkpointer | None
    metrics: MetricsWriter
    data_note: str | None = None
    """What the data pipeline reports at the start (SFT rows, truncation counts)."""
    data_record: dict[str, Any] | None = None
    """The same as data, for metrics.jsonl (fsdpkit.data.TrainingData.record)."""
    rl: RlRun | None = None
    """Under train.objective = grpo: the rollout engine, rewards and reference
    ([Note: the GRPO step] in fsdpkit.train.rl_step). None otherwise."""

    def app_state(self) -> dict[str, Any]:
        """What a checkpoint holds (DCP Statefuls)."""

        only = self.cfg.checkpoint.adapters_only
        run, pipeline = self.trainable, self.trainable.pipeline
        state: dict[str, Any] = {
            "app": ModelOptimizerState(
                run.model,
                run.optimizer,
                trainable_only=only,
                group_names=pipeline.group_names if pipeline is not None else None,
                tied=pipeline.tied_names if pipeline is not None else None,
            ),
            "scheduler": self.scheduler,
            "trainer": self.state,
            "rng": RankLocal(RNGState()),
        }
        if run.finetune.active:
            across, skip = (pipeline.group, pipeline.uncounted()) if pipeline else (None, [])
            state["frozen"] = FrozenBase(run.model, check=only, across=across, skip=skip)
        return state


def _backend(cfg: RunConfig, env: DistEnv) -> str:
    """gloo on CPU; NCCL on GPUs, plus gloo for CPU tensors when parameters are offloaded
    (clipping and the fp16 scaler reduce CPU DTensors then; NCCL alone cannot)."""
    if env.device_type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cfg.offload.params else "nccl"


def init_process_group(cfg: RunConfig, env: DistEnv) -> torch.device:
    """gloo on CPU, NCCL on GPUs; the configured collective timeout."""
    if env.device_type == "cuda":
        torch.cuda.set_device(env.local_rank)
        device = torch.device("cuda", env.local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=cfg.parallel.timeout_s)
        pin_collectives(env)  # gloo / NCCL sockets on one interface ([Note: listeners])
        dist.init_process_group(
            backend=_backend(cfg, env),
            store=rendezvous_store(env, timeout=timeout),
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
            device_id=device if env.device_type == "cuda" else None,
        )
    return device


def _data(
    cfg: RunConfig,
    env: DistEnv,
    split: BatchSplit,
    dims: ParallelDims,
    *,
    rewards: Rewards | None = None,
) -> TrainingData:
    """This rank's data: the one pipeline (fsdpkit.data.open_training_data) prepares raw
    sources into the run directory once per node and maps the shards; no collective.
    GRPO: prompt rows with the columns ``rewards`` read (fsdpkit.data.prompt_order)."""
    if rewards is not None:
        return open_prompt_data(
            cfg.data,
            max_prompt_length=cfg.rl.max_prompt_length,
            prompts_per_step=split.global_batch // cfg.rl.num_generations,
            seed=cfg.train.seed,
            dp_rank=dims.dp_rank(env.rank),
            dp_world=dims.dp,
            required=rewards.required_columns,
        )
    if cfg.train.objective == "dpo":  # preference pairs (fsdpkit.data.preference)
        ranks = {"dp_rank": dims.dp_rank(env.rank), "dp_world": dims.dp}
        opts = {"seed": cfg.train.seed, "eval_batches": cfg.train.eval_batches}
        return open_preference_data(cfg.data, split=split, **ranks, **opts)
    return open_training_data(
        cfg.data,
        seed=cfg.train.seed,
        micro_batch=split.micro_batch,
        grad_accum=split.grad_accum,
        dp_rank=dims.dp_rank(env.rank),
        dp_world=dims.dp,
        eval_batches=cfg.train.eval_batches,
        work_dir=Path(cfg.logging.run_dir),
        steps=cfg.train.steps,
    )


def build_session(cfg: RunConfig, env: DistEnv) -> Session:
    """Set up this rank; collective (every rank must call it). Data, model and block
    choice are checked before the process group starts, so bad input fails every rank
    alike without any collective ([Note: one builder])."""
    if cfg.train.objective == "grpo":
        check_rl_lengths(cfg)  # named by the [rl] keys, before data.seq_len is derived
    cfg = with_rl_context(with_model_tokenizer(cfg))
    dims = parallel_dims(cfg, world_size=env.world_size, local_world_size=env.local_world_size)
    split = batch_split(cfg.train, dp_world=dims.dp)
    grpo = cfg.train.objective == "grpo"
    if grpo:  # the global batch at this world size counts whole groups
        check_grpo_batch(cfg.rl, global_batch=split.global_batch)
    rewards = build_rewards(cfg.rl) if grpo else None  # users' functions imported here
    data = _data(cfg, env, split, dims, rewards=rewards)
    unsharded = build_unsharded(
        cfg, vocab_size=data.tokenizer.vocab_size, device_type=env.device_type, sft=data.sft
    )
    reference = build_reference_unsharded(  # the frozen reference ([Note: reference model])
        cfg, vocab_size=data.tokenizer.vocab_size, device_type=env.device_type
    )
    device = init_process_group(cfg, env)
    mesh = build_mesh(dims, device_type=env.device_type)
    run = shard_trainable(unsharded, cfg, mesh=mesh, device=device)
    if cfg.train.objective == "dpo":
        pipe = run.pipeline  # under pp the reference is cut into its stages
        whole = reference if pipe is None else None
        run.loss_fn = DpoLoss(
            cfg.dpo,
            reference=shard_reference(whole, cfg, mesh=mesh, device=device) if whole else None,
            lora=bool(cfg.lora.rank),
            mesh=mesh,
            ring=cfg.parallel.cp_attention == "ring",
        )
        if pipe is not None:  # [Note: preference pairs through pipeline stages]
            stages = None
            if reference is not None:
                stages = shard_reference_stages(reference, cfg, like=pipe, mesh=mesh, device=device)
            pipelined_dpo(pipe, run.loss_fn, reference=stages)
        run.loss_note = run.loss_fn.describe()  # its own loss: the chunked-loss note is moot
    rl = None
    if rewards is not None:
        ref = shard_reference(reference, cfg, mesh=mesh, device=device) if reference else None
        rl = build_rl(
            cfg,
            model=run.model,
            tokenizer=data.tokenizer,
            device=device,
            rewards=rewards,
            reference=ref,
            low_precision=run.precision.low_precision,
            compute_dtype=run.precision.param_dtype,
        )
        run.loss_note = describe_rl(rl, cfg)
    scaler = make_grad_scaler(run.precision, device_type=env.device_type)
    run_dir = Path(cfg.logging.run_dir)
    return Session(
        cfg=cfg,
        env=env,
        split=split,
        mesh=mesh,
        device=device,
        run_dir=run_dir,
        tokenizer=data.tokenizer,
        loader=data.loader,
        val=data.val,
        trainable=run,
        scheduler=build_scheduler(run.optimizer, cfg.train),
        scaler=scaler,
        state=TrainerState(loader=data.loader, scaler=scaler),
        checkpointer=_checkpointer(
            cfg,
            env,
            run_dir=run_dir,
            dims=dims,
            llama=run.llama,
            finetune=run.finetune.record(),
        ),
        metrics=MetricsWriter(run_dir / "metrics.jsonl", enabled=env.rank == 0),
        data_note=data.note,
        data_record=data.record,
        rl=rl,
    )


def _checkpointer(
    cfg: RunConfig,
    env: DistEnv,
    *,
    run_dir: Path,
    dims: ParallelDims,
    llama: LlamaConfig | None,
    finetune: dict[str, Any] | None = None,
) -> Checkpointer | None:
    """None when the run neither saves nor resumes (checkpoint.every = 0, resume = never)."""
    if cfg.checkpoint.every == 0 and cfg.checkpoint.resume == "never":
        return None
    meta = {
        "world_size": env.world_size,
        "mesh": _mesh_record(dims),
        "strategy": cfg.parallel.strategy,
        "config": cfg.to_dict(),
        "model": llama.to_dict() if llama is not None else None,
        "finetune": finetune,
    }
    return Checkpointer(run_dir=run_dir, cfg=cfg.checkpoint, run_meta=meta)


def _mesh_record(dims: ParallelDims) -> dict[str, int]:
    """The checkpoint's ``run.mesh``: the data axes always (format 1), a cp / tp axis
    only where the run has one (an additive key older readers ignore)."""
    return {name: d for name, d in dims.named() if name in ("replicate", "shard") or d > 1}


def write_run_dir(session: Session) -> None:
    """Resolved config (re-runnable with ``fsdpkit train config.toml``), and for
    model.hf its HF files; rank 0 only (the caller: fsdpkit.train.loop.claim_run_dir).
    RunDirError on a file-system fault ([Note: run-dir faults])."""
    if session.env.rank != 0:
        return
    versions = written_by()
    header = (
        f"# written by fsdpkit {versions['fsdpkit_version']} (torch {versions['torch_version']})\n"
    )
    write_text_atomically(
        session.run_dir / "config.toml", header + to_toml(session.cfg), what="the resolved config"
    )
    if session.cfg.model.hf:  # what `fsdpkit ckpt export --format hf` ships with the weights
        try:
            copy_hf_files(Path(session.cfg.model.hf).expanduser(), session.run_dir / HF_RUN_DIR)
        except OSError as exc:
            raise RunDirError(
                f"cannot copy the model's HF files into {session.run_dir / HF_RUN_DIR}: "
                f"{describe_os_error(exc)}. Free space or fix the permissions of logging.run_dir."
            ) from None
