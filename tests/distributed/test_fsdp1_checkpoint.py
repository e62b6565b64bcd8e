"""FSDP1 checkpoints load into fsdpkit (``model.init_from``): real FSDP1 runs on 2 gloo
ranks save SHARDED_STATE_DICT (DCP) and FULL_STATE_DICT (torch) checkpoints the way
Accelerate lays them out; fsdpkit loads each into its sharded built-in Llama (at two
strategies) and the logits equal the FSDP1 model's. Mismatches are one clear error.
Finally ``fsdpkit train model.init_from=...`` starts from the FSDP1 weights.

One spawn saves, one spawn loads, one CLI run trains (start-up dominates).
"""

from __future__ import annotations

import functools
import pathlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdpkit.testing import run_ranks
from support import TINY, build, lm_loss

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLD = 2
CFG = replace(TINY, vocab_size=256)  # the byte vocabulary: the e2e test trains from it
TOKENS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))


class Evil:
    """Pickles to a call that creates a file: loading must never run it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def save_fsdp1(rank: int, world: int, out: str) -> dict[str, Any]:
    """FSDP1 (flat parameters, transformer wrap, activation checkpointing), one AdamW
    step away from init, then both checkpoint kinds as Accelerate writes them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp import FullStateDictConfig, ShardingStrategy, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    from fsdpkit.models.llama import DecoderLayer

    model = FSDP(
        build(CFG, seed=11),  # not fsdpkit's default seed: loading must change the weights
        auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={DecoderLayer}
        ),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        use_orig_params=True,
        device_id=torch.device("cpu"),
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
        ),
        check_fn=lambda m: isinstance(m, DecoderLayer),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    lm_loss(
        model, torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(rank))
    ).backward()
    opt.step()
    acc = Path(out, "accelerate")
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save({"model": model.state_dict()}, checkpoint_id=acc / "pytorch_model_fsdp_0")
    # offload_to_cpu=True crashes FSDP1 on a CPU-only machine (segfault in clone).
    full_cfg = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, full_cfg):
        full = model.state_dict()
    wrapped_names = [n for n, _ in model.named_parameters()]  # with the wrapper prefixes
    with FSDP.summon_full_params(model):
        values = [p.detach().clone() for _, p in model.named_parameters()]
        raw = dict(zip(wrapped_names, values))  # a "named_parameters dump" of the full model
        logits = model(TOKENS).detach()
    if rank == 0:
        torch.save(full, acc / "pytorch_model_fsdp.bin")
        torch.save(raw, Path(out, "named_parameters.pt"))
        torch.save({"weights": full, "extra": Evil(str(Path(out, "pwned")))}, Path(out, "evil.pt"))
        torch.save(logits, Path(out, "logits.pt"))
        untied = {**full, "lm_head.weight": full["lm_head.weight"] + 1}
        torch.save(untied, Path(out, "untied.pt"))
    return {"raw_keys": sorted(raw)[:3], "full_keys": sorted(full)}


def load_fsdpkit(rank: int, world: int, out: str) -> dict[str, Any]:
    """Each checkpoint kind into fsdpkit's sharded Llama (full shard, and replicate for
    a different mesh); logits on the same tokens. Mismatching models: the errors."""
    from fsdpkit import RunConfig, build_mesh, shard
    from fsdpkit.checkpoint import CheckpointError
    from fsdpkit.config import ParallelConfig, ParallelDims
    from fsdpkit.migrate import load_fsdp1_checkpoint

    acc = Path(out, "accelerate")
    sources = {
        "accelerate dir": acc,
        "sharded (DCP)": acc / "pytorch_model_fsdp_0",
        "full (torch)": acc / "pytorch_model_fsdp.bin",
        "wrapper names": Path(out, "named_parameters.pt"),
    }
    results: dict[str, Any] = {"logits": {}, "kinds": {}, "errors": {}}
    for strategy in ("full", "replicate"):
        cfg = RunConfig(parallel=ParallelConfig(strategy=strategy))
        mesh = build_mesh(
            ParallelDims(replicate=world, shard=1) if strategy == "replicate" else None
        )
        for name, path in sources.items():
            model = build(CFG, meta=True)
            shard(model, cfg, mesh=mesh)
            results["kinds"][name] = load_fsdp1_checkpoint(model, path)
            with torch.no_grad():
                results["logits"][f"{name}, {strategy}"] = model(TOKENS).detach()
    mesh = build_mesh()
    wrong = {
        "fewer layers": (replace(CFG, n_layers=3), sources["sharded (DCP)"]),
        "more layers": (replace(CFG, n_layers=5), sources["full (torch)"]),
        "other vocab": (replace(CFG, vocab_size=128), sources["sharded (DCP)"]),
        "pickled code": (CFG, Path(out, "evil.pt")),
        "untied head": (CFG, Path(out, "untied.pt")),
    }
    for name, (model_cfg, path) in wrong.items():
        model = build(model_cfg, meta=True)
        shard(model, RunConfig(), mesh=mesh)
        try:
            load_fsdp1_checkpoint(model, path)
        except CheckpointError as exc:
            results["errors"][name] = str(exc)
    return results


def test_fsdp1_checkpoints_load_into_fsdpkit(tmp_path: Path) -> None:
    saved = run_ranks(save_fsdp1, world_size=WORLD, args=(str(tmp_path),))[0]
    assert any("_checkpoint_wrapped_module." in k for k in saved["raw_keys"])
    assert "lm_head.weight" in saved["full_keys"]  # the tied alias is in FSDP1's file
    loaded = run_ranks(load_fsdpkit, world_size=WORLD, args=(str(tmp_path),))
    expected = torch.load(tmp_path / "logits.pt")
    for rank_result in loaded:
        assert rank_result["kinds"] == {
            "accelerate dir": "dcp",
            "sharded (DCP)": "dcp",
            "full (torch)": "torch",
            "wrapper names": "torch",
        }
        assert len(rank_result["logits"]) == 8
        for name, logits in rank_result["logits"].items():
            torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5, msg=name)
    errors = loaded[0]["errors"]
    assert "model.layers.3.mlp.up_proj.weight" in errors["fewer layers"]
    assert "checkpoint weights the model does not have" in errors["fewer layers"]
    assert "prefix 'model.'" in errors["fewer layers"]  # Accelerate nests under "model"
    assert "weights the model needs are missing" in errors["more layers"]
    assert "model.layers.4.self_attn.q_proj.weight" in errors["more layers"]
    assert (
        "model.embed_tokens.weight (checkpoint (256, 64) vs model (128, 64))"
        in errors["other vocab"]
    )
    assert "weights-only" in errors["pickled code"]
    assert not (tmp_path / "pwned").exists()  # the pickled call never ran
    assert (
        "lm_head.weight differs from the parameter this model ties it to" in errors["untied head"]
    )
    train_from_fsdp1(tmp_path)


def train_from_fsdp1(tmp_path: Path) -> None:
    """The CLI path: train one step at lr 0 from the Accelerate output directory; the
    checkpoint it saves holds exactly the FSDP1 weights."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from e2e.clirun import fsdpkit

    shape = [
        f"model.{k}={getattr(CFG, k)}"
        for k in ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim")
    ]
    run = tmp_path / "run"
    result = fsdpkit(
        "train",
        f"model.init_from={tmp_path / 'accelerate'}",
        *shape,
        "train.steps=1",
        "train.lr=0",
        "train.eval_every=0",
        "train.sample_tokens=0",
        "data.max_bytes=100000",
        "data.seq_len=32",
        "checkpoint.every=1",
        f"logging.run_dir={run}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    dcp_to_torch_save(run / "checkpoints" / "step-00000001", tmp_path / "saved.pt")
    saved = torch.load(tmp_path / "saved.pt", weights_only=False)
    fsdp1 = torch.load(tmp_path / "accelerate" / "pytorch_model_fsdp.bin", weights_only=True)
    model = saved["app"]["model"]
    assert set(model) == set(fsdp1) - {"lm_head.weight"}  # the tied alias is stored once
    for key, value in model.items():
        assert torch.equal(value, fsdp1[key]), key
