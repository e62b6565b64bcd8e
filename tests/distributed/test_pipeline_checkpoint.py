"""A pipelined run's checkpoint (pp2 x dp2) resumes without pp (dp4) and at pp4 with
the same next losses and grad norms as the pp2 x dp2 run that never stopped: the
model's own names, and the whole model's optimizer groups ([Note: optimizer groups
across stages]), make the checkpoint independent of the stage layout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from fsdpkit.config import load
from fsdpkit.runtime.distenv import joined_env
from fsdpkit.testing import run_ranks
from fsdpkit.train.loop import run
from fsdpkit.train.session import build_session
from support import preference_pairs

pytestmark = pytest.mark.distributed

BASE = [
    *("model.preset=tiny", "model.dim=64", "model.n_layers=4", "model.n_heads=4"),
    *("model.n_kv_heads=2", "model.ffn_dim=128", "model.tie_embeddings=false"),
    *("data.seq_len=32", "train.lr=2e-4", "train.warmup_steps=0", "train.schedule=constant"),
    *("train.global_batch_size=8", "train.micro_batch_size=1", "train.eval_every=0"),
    *("train.sample_tokens=0", "precision.mode=fp32", "logging.progress=none"),
    *("checkpoint.every=2", "checkpoint.resume=auto"),
]  # fmt: skip
"""A constant LR: the run stopped at step 2 and the one that goes on to 4 follow the
same schedule."""


def _train(rank: int, world: int, overrides: list[str]) -> int:
    env = joined_env()
    assert env is not None and env.world_size == world
    return run(build_session(load(None, overrides), env)).steps


def _metrics(run_dir: Path) -> list[tuple[float, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["loss"], r["grad_norm"]) for r in records if "loss" in r]


def _spawn(run_dir: Path, *overrides: str, base: list[str] = BASE) -> None:
    args = ([*base, *overrides, f"logging.run_dir={run_dir}"],)
    run_ranks(_train, world_size=4, args=args, timeout_s=600)


def test_pipelined_checkpoint_resumes_at_other_layouts(tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    _spawn(straight, "parallel.pp=2", "train.steps=4")  # saves steps 2 and 4
    meta: dict[str, Any] = json.loads(
        (straight / "checkpoints" / "step-00000002" / "fsdpkit.json").read_text()
    )
    assert meta["run"]["mesh"] == {"pp": 2, "replicate": 1, "shard": 2}
    want = _metrics(straight)[2:]
    for name, layout in (("dp4", []), ("pp4", ["parallel.pp=4"])):
        shutil.copytree(straight, tmp_path / name)
        shutil.rmtree(tmp_path / name / "checkpoints" / "step-00000004")  # resume from 2
        _spawn(tmp_path / name, *layout, "train.steps=4")
        got = _metrics(tmp_path / name)[2:]
        assert len(got) == 2, name
        for (loss, norm), (ref_loss, ref_norm) in zip(got, want, strict=True):
            assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (name, got, want)
            assert abs(norm - ref_norm) <= 1e-5 * abs(ref_norm), (name, got, want)


TIED_RESUMES = {"1F1B": ("dp4",), "ZBVZeroBubble": ("dp4", "zbv")}
"""The schedule of the pipelined run -> the layouts its checkpoint resumes at: 1F1B
holds the two copies on two ranks, ZBVZeroBubble on one (and resumes into that)."""


def _saved_keys(step: Path) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return sorted(FileSystemReader(str(step)).read_metadata().state_dict_metadata)


@pytest.mark.parametrize(
    "schedule", ["1F1B", pytest.param("ZBVZeroBubble", marks=pytest.mark.slow)]
)
def test_tied_pipelined_checkpoint_resumes_without_pp_and_exports_as_one(
    tmp_path: Path, schedule: str
) -> None:
    """A tied embedding and head ([Note: tied embeddings across stages]): the
    checkpoint holds the one tensor under the embedding's name (and its optimizer
    state once), the record says which alias it stands for, the run resumes at dp4
    (and into the V schedule) with the same next losses, and the export is the one a
    run without pp writes (the same keys; the values agree)."""
    from safetensors.torch import load_file

    from fsdpkit.export.offline import export

    tied = [o for o in BASE if not o.startswith("model.tie")] + ["model.tie_embeddings=true"]
    straight = tmp_path / "straight"
    pp = ["parallel.pp=2", f"parallel.pp_schedule={schedule}"]
    _spawn(straight, *pp, "train.steps=4", base=tied)
    step2 = straight / "checkpoints" / "step-00000002"
    meta: dict[str, Any] = json.loads((step2 / "fsdpkit.json").read_text())
    assert meta["state"]["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    keys = _saved_keys(step2)
    assert not [k for k in keys if "lm_head" in k], keys
    assert [k for k in keys if "embed_tokens.weight.exp_avg_sq" in k], keys
    want = _metrics(straight)[2:]
    for name in TIED_RESUMES[schedule]:
        resumed = tmp_path / name
        shutil.copytree(straight, resumed)
        shutil.rmtree(resumed / "checkpoints" / "step-00000004")
        _spawn(resumed, "train.steps=4", *(pp if name == "zbv" else []), base=tied)
        got = _metrics(resumed)[2:]
        assert len(got) == 2
        for (loss, norm), (ref_loss, ref_norm) in zip(got, want, strict=True):
            assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (name, got, want)
            assert abs(norm - ref_norm) <= 1e-5 * abs(ref_norm), (name, got, want)
    exported = {}
    for name in ("straight", "dp4"):
        out = export(tmp_path / name / "checkpoints" / "step-00000004", tmp_path / f"hf-{name}")
        exported[name] = load_file(str(next(out.glob("*.safetensors"))))
    assert sorted(exported["straight"]) == sorted(exported["dp4"])
    for key, value in exported["dp4"].items():
        assert (exported["straight"][key] - value).abs().max().item() <= 1e-5, key


LORA = ["lora.rank=4", "lora.alpha=8", "checkpoint.adapters_only=true"]
FINETUNES = {
    "lora": LORA,
    "tied-lora": [*LORA, "model.tie_embeddings=true"],
    "dpo-lora": ["train.objective=dpo", "dpo.beta=0.5", "lora.rank=4", "lora.alpha=8"],
    "dpo-full": ["train.objective=dpo", "dpo.beta=0.5"],
}
"""Fine-tuning under pp whose checkpoint must reshard: LoRA with adapters-only
checkpoints (the base is built from the seed again and checked by its fingerprint over
every stage: [Note: adapters need their base]), the same with a tied embedding and head
(the last stage's copy of the frozen weight not counted twice), DPO with LoRA (the
reference is the base with the adapters off) and full DPO (a separate reference in the
same stages, built again from the seed on resume). Later overrides win over BASE's."""


def _resume_from(source: Path, into: Path, *, step: int) -> None:
    """A copy of ``source`` that resumes from ``step``: the later checkpoints dropped."""
    shutil.copytree(source, into)
    for later in (into / "checkpoints").glob("step-*"):
        if int(later.name.removeprefix("step-")) > step:
            shutil.rmtree(later)


@pytest.mark.parametrize(
    "name",
    [
        "tied-lora",
        *(pytest.param(n, marks=pytest.mark.slow) for n in ("lora", "dpo-lora", "dpo-full")),
    ],
)
def test_finetuned_pipelined_checkpoint_reshards_without_pp_and_back(
    tmp_path: Path, name: str
) -> None:
    """pp2 x dp2 to step 6 straight; from its step 2 at dp4 (steps 3-4), and from that
    dp4 run's step 4 at pp2 again (steps 5-6): the same losses and grad norms as the run
    that never stopped, whichever layout wrote the checkpoint."""
    data = [f"data.path={preference_pairs(tmp_path)}"] if "dpo" in name else []
    settings = [*FINETUNES[name], *data]
    straight = tmp_path / "straight"
    _spawn(straight, "parallel.pp=2", "train.steps=6", *settings)
    want = _metrics(straight)
    assert len(want) == 6
    dp4, back = tmp_path / "dp4", tmp_path / "back"
    _resume_from(straight, dp4, step=2)
    _spawn(dp4, "train.steps=4", *settings)
    _resume_from(dp4, back, step=4)
    _spawn(back, "parallel.pp=2", "train.steps=6", *settings)
    got = {"dp4": _metrics(dp4)[2:], "back": _metrics(back)[4:]}
    for layout, expected in (("dp4", want[2:4]), ("back", want[4:6])):
        assert len(got[layout]) == 2, (layout, got)
        for (loss, norm), (ref_loss, ref_norm) in zip(got[layout], expected, strict=True):
            assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (layout, got, want)
            assert abs(norm - ref_norm) <= 1e-5 * abs(ref_norm), (layout, got, want)
