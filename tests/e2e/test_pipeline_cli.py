"""``fsdpkit train`` with pipeline parallelism, as a user runs it: the first lines say
which blocks each pipeline rank holds, the loss falls, validation runs, the checkpoint
exports to the same HF names as any run; a layout the world, the model or the batch
cannot take is one paragraph naming the field, exit 2, before any worker starts."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from clirun import fsdpkit, losses
from safetensors.torch import load_file

pytestmark = pytest.mark.e2e

COMMON = [
    *("--nproc", "4", "train.steps=6", "model.n_layers=4", "model.dim=64"),
    *("model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=96", "data.seq_len=32"),
    *("data.max_bytes=300000", "train.global_batch_size=8", "train.micro_batch_size=1"),
    *("train.eval_every=3", "train.sample_tokens=0", "logging.report=false"),
]  # fmt: skip
UNTIED = "model.tie_embeddings=false"


def _train(tmp: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return fsdpkit("train", *COMMON, f"logging.run_dir={tmp / 'run'}", *extra, cwd=tmp, timeout=400)


@pytest.mark.distributed
def test_pipelined_run_states_its_split_and_trains(tmp_path: Path) -> None:
    """The preset's own tied embedding and head ([Note: tied embeddings across stages]):
    the export holds the one weight, as a run without pp writes it."""
    run = _train(tmp_path, "parallel.pp=2", "checkpoint.every=6")
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "pipeline: 2 ranks x 1 stage(s), Schedule1F1B over 4 micro-batches" in out, out[:3000]
    assert "pp rank 0: stage 0: embedding + blocks 0-1" in out
    assert "pp rank 1: stage 1: blocks 2-3 + norm, head, loss" in out
    assert "tied embedding and head: the last stage holds a copy of the weight" in out
    assert "validation loss" in out
    curve = losses(tmp_path / "run")
    assert len(curve) == 6 and curve[-1] < curve[0]
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000006"
    done = fsdpkit(
        "ckpt", "export", str(ckpt), "--format", "hf", str(tmp_path / "hf"), cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    tensors = load_file(str(tmp_path / "hf" / "model-00001-of-00001.safetensors"))
    assert "model.embed_tokens.weight" in tensors and "lm_head.weight" not in tensors
    assert {f"model.layers.{i}.mlp.down_proj.weight" for i in range(4)} <= tensors.keys()


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ((UNTIED, "parallel.pp=3"), "parallel.pp x parallel.tp x parallel.cp = 3 x 1 x 1"),
        ((UNTIED, "parallel.pp=4", "model.n_layers=3"), "3 blocks, fewer than its 4 pipeline"),
        ((UNTIED, "parallel.pp=4", "train.global_batch_size=2"), "1F1B needs at least pp = 4"),
        (
            (UNTIED, "parallel.pp=2", "parallel.accum_sync=every"),
            "parallel.pp = 2 cannot be combined with",
        ),
    ],
)
def test_bad_pipeline_layout_is_one_paragraph_before_any_worker(
    tmp_path: Path, overrides: tuple[str, ...], field: str
) -> None:
    started = time.monotonic()
    run = _train(tmp_path, *overrides)
    assert run.returncode == 2, run.stderr[-2000:]
    assert field in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()  # no worker, no run directory
    assert time.monotonic() - started < 60


def test_a_model_that_changes_the_hidden_state_at_a_cut_is_refused(tmp_path: Path) -> None:
    """[Note: stage boundaries]: the second stage would scale what it receives again;
    its first forward stops the run with one paragraph (exit 2), every rank ended."""
    started = time.monotonic()
    run = fsdpkit(
        "train", *COMMON[:2], "model.factory=factories:scaled_embedding", "parallel.pp=2",
        "train.steps=2", "data.seq_len=32", "data.max_bytes=200000", "train.micro_batch_size=1",
        "train.global_batch_size=4", f"logging.run_dir={tmp_path / 'run'}", cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr[-2000:]
    assert "ScaledEmbedding's forward changes the input embedding's output" in run.stderr
    assert "Traceback" not in run.stderr
    assert time.monotonic() - started < 120


def test_a_pipeline_rank_with_nothing_to_train_is_refused(tmp_path: Path) -> None:
    """``model.freeze`` of the embedding and the first stage's blocks: that rank would
    step an optimizer over nothing (torch's bare "empty parameter list" before); every
    rank stops with the paragraph naming the rank, its stage and the way out, exit 2."""
    frozen = 'model.freeze=["model.embed_tokens.*","model.layers.[0-1].*"]'
    run = _train(tmp_path, UNTIED, "parallel.pp=2", frozen)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "model.freeze leaves pipeline rank(s) [0] nothing to train" in run.stderr
    assert "pp rank 0: stage 0: embedding + blocks 0-1" in run.stderr
    assert "Traceback" not in run.stderr
