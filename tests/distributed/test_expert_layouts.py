"""Mixture-of-experts models in model-parallel layouts (issue 50, items 1 and 2).

- Under tensor parallelism: attention split by tp, the experts and router on each tp
  rank's own tokens, the experts split by ep on a mesh axis of their own ([Note:
  experts under tensor parallelism] in fsdpkit.sharding.tensor.moe): the built-in MoE
  model (moe-tiny) at ep2 x tp2, tp2 (dp2 x tp2, the experts whole on each tp rank) and
  tp2 x cp2 (Ulysses); transformers' Qwen3-MoE at ep2 x tp2 and tp2; Mixtral and
  Qwen2-MoE (a shared expert, split by tp, and its gate) at tp2.
- Under pipeline parallelism, with ep inside each stage: each stage splits its own
  blocks' experts over its ep ranks, and the router loss travels with the hidden
  states ([Note: the router loss across stages] in fsdpkit.sharding.pipeline.routing):
  the built-in model at pp2 x ep2, pp2 x dp2 (ep 1) and pp2 x tp2, Qwen3-MoE at pp2 x
  ep2, through 1F1B.

Each layout runs the real trainer on 4 gloo ranks (tests/layout_runs.py): 10 AdamW
steps in fp32 with global-norm clipping on the built-in corpus, two micro-batches a
step of 4 sequences over all data ranks (the router loss is per global micro-batch:
[Note: equal batches on every rank] in fsdpkit.data.loader gives every layout, and
the one process, the same ones), the router loss at 0.1. Losses, grad norms and every
final parameter (from whichever stage holds it) are within 1e-5 of one process; under
pp the logged router loss too. A resharded layout's step-5 checkpoint resumes at FSDP
alone (dp4), and dp4's resumes in the layout, the next losses within 1e-6 relative of
the run that went on. ``make test`` runs ep2 x tp2 and pp2 x ep2 of the built-in
model (about 50 s each); the rest is slow-marked.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from layout_runs import (
    assert_same_next_losses,
    assert_trains_as_one_process,
    metrics,
    resume,
    train,
)

STEPS = 10
SAVED = 5
COMMON = [
    *("data.seq_len=32", f"train.steps={STEPS}", "train.lr=2e-4", "train.warmup_steps=0"),
    *("train.schedule=constant", "train.grad_clip=1.0", "train.global_batch_size=8"),
    *("train.eval_every=0", "train.sample_tokens=0", "precision.mode=fp32"),
    *("logging.progress=none", f"checkpoint.every={SAVED}", "checkpoint.resume=never"),
    "model.router_aux_loss_coef=0.1",
]  # fmt: skip
"""A constant LR (a resumed run follows the same schedule); the router loss larger than
the families' defaults, so a wrong one shows."""
BUILTIN = ["model.preset=moe-tiny"]


def _degree(layout: list[str], key: str) -> int:
    return next((int(o.split("=")[1]) for o in layout if o.startswith(f"parallel.{key}=")), 1)


def cap(layout: list[str], *, world: int = 4) -> str:
    """``train.micro_batch_size`` giving 2 micro-batches of 4 sequences over the data
    ranks (world / (tp x cp x pp)) a step."""
    dp = world // (_degree(layout, "tp") * _degree(layout, "cp") * _degree(layout, "pp"))
    return f"train.micro_batch_size={4 // dp}"


def model(kind: str, tmp: Path) -> list[str]:
    """``model.*`` and ``data.*`` of ``kind``: the built-in MoE, or a tiny transformers
    family (2 layers, 4 experts, top 2, its own tokenizer) written once under ``tmp``;
    the corpus prepared once per tokenizer (``data.cache_dir``)."""
    cache = f"data.cache_dir={tmp / 'data'}"
    if kind == "builtin":
        return [*BUILTIN, cache]
    from tiny_hf import write_tiny_model

    out = tmp / kind
    if not out.exists():
        write_tiny_model(out, arch=kind, dim=32, layers=2)
        config = json.loads((out / "config.json").read_text())
        config["router_aux_loss_coef"] = 0.1
        (out / "config.json").write_text(json.dumps(config))
    return [f"model.hf={out}", cache]


class Runs:
    """The runs of one test module, each trained once, in ``tmp``."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.done: dict[str, dict[str, Any]] = {}

    def run(self, name: str, kind: str, layout: list[str], *, world: int = 4) -> dict[str, Any]:
        if name not in self.done:
            run_dir = self.tmp / name
            overrides = [*COMMON, *model(kind, self.tmp), *layout, cap(layout, world=world)]
            got = train(run_dir, overrides, world=world)
            self.done[name] = {"ranks": got, "metrics": metrics(run_dir), "dir": run_dir}
        return self.done[name]

    def reference(self, kind: str) -> dict[str, Any]:
        one = self.run(f"{kind}-one", kind, [], world=1)
        return {"params": one["ranks"][0]["params"], "metrics": one["metrics"]}

    def check_parity(self, name: str, kind: str, layout: list[str]) -> dict[str, Any]:
        """The layout's run against one process; its first rank's result."""
        got = self.run(name, kind, layout)
        assert "router load-balancing loss x 0.1" in got["ranks"][0]["loss_note"]
        far = assert_trains_as_one_process(got["ranks"], got["metrics"], self.reference(kind))
        print(f"{name}: worst differences {far}")
        return got["ranks"][0]  # type: ignore[no-any-return]

    def check_reshard(self, name: str, kind: str, layout: list[str]) -> None:
        """The layout's step-5 checkpoint resumes at FSDP alone (dp4), and dp4's resumes
        in the layout, the next losses as the runs that went on."""
        straight = self.run(name, kind, layout)
        fsdp = self.run(f"{kind}-dp4", kind, [])
        base = [*COMMON, *model(kind, self.tmp)]
        to_fsdp = resume(
            straight["dir"], self.tmp / f"{name}-to-dp4", [*base, cap([])],
            step=SAVED, last=STEPS, world=4,
        )  # fmt: skip
        back = resume(
            fsdp["dir"], self.tmp / f"dp4-to-{name}", [*base, *layout, cap(layout)],
            step=SAVED, last=STEPS, world=4,
        )  # fmt: skip
        there = assert_same_next_losses(to_fsdp, straight["metrics"]["loss"][SAVED:])
        home = assert_same_next_losses(back, fsdp["metrics"]["loss"][SAVED:])
        print(f"{name}: resumed at dp4 {there:.2e}, dp4 resumed in the layout {home:.2e}")


pytestmark = pytest.mark.distributed

LAYOUTS: dict[str, tuple[str, list[str]]] = {
    "builtin-ep2xtp2": ("builtin", ["parallel.ep=2", "parallel.tp=2"]),
    "builtin-pp2xep2": ("builtin", ["parallel.pp=2", "parallel.ep=2"]),
    "builtin-tp2": ("builtin", ["parallel.tp=2"]),
    "builtin-pp2xdp2": ("builtin", ["parallel.pp=2"]),
    "qwen3_moe-ep2xtp2": ("qwen3_moe", ["parallel.ep=2", "parallel.tp=2"]),
    "qwen3_moe-tp2": ("qwen3_moe", ["parallel.tp=2"]),
    "qwen3_moe-pp2xep2": ("qwen3_moe", ["parallel.pp=2", "parallel.ep=2"]),
    "mixtral-tp2": ("mixtral", ["parallel.tp=2"]),
    "qwen2_moe-tp2": ("qwen2_moe", ["parallel.tp=2"]),
    "builtin-tp2xcp2": ("builtin", ["parallel.tp=2", "parallel.cp=2"]),
    "builtin-pp2xtp2": ("builtin", ["parallel.pp=2", "parallel.tp=2"]),
}
"""Layout -> (model, overrides) at 4 ranks."""
FAST = ("builtin-ep2xtp2", "builtin-pp2xep2")
RESHARDED = (
    *("builtin-ep2xtp2", "builtin-tp2", "builtin-pp2xep2"),
    *("qwen3_moe-ep2xtp2", "qwen3_moe-tp2", "qwen3_moe-pp2xep2"),
)
"""Layouts whose checkpoints reshard to FSDP alone and back."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    os.environ["HF_HUB_OFFLINE"] = "1"
    return Runs(tmp_path_factory.mktemp("moe-layouts"))


def _check(runs: Runs, name: str) -> None:
    kind, layout = LAYOUTS[name]
    plan = runs.check_parity(name, kind, layout)["plan"]
    if "parallel.tp=2" in layout:
        blocks = "1 MoE block" if "parallel.pp=2" in layout else "2 MoE blocks"  # per stage
        assert f"experts and routers of {blocks} on each rank's own tokens" in plan, plan
    if layout == ["parallel.ep=2", "parallel.tp=2"]:
        assert "expert parallel 2 (2 of 4 experts per rank, whole on each of 2 tp" in plan, plan
    if kind == "qwen2_moe":  # its shared expert's three linears, in each of 2 blocks
        assert "14 linears split" in plan, plan
    if "parallel.pp=2" in layout:  # the last stage's router loss, logged every step
        if "parallel.ep=2" in layout:  # one block per stage, its experts split
            assert "expert parallel 2 (2 of 4 experts per rank)" in plan, plan
        aux = runs.run(name, kind, layout)["metrics"]["aux_loss"]
        want = runs.reference(kind)["metrics"]["aux_loss"]
        assert len(aux) == len(want) == STEPS
        assert max(abs(a - b) for a, b in zip(aux, want, strict=True)) <= 1e-5, (aux, want)


@pytest.mark.parametrize("name", FAST)
def test_moe_layout_trains_as_one_process(runs: Runs, name: str) -> None:
    _check(runs, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in LAYOUTS if n not in FAST])
def test_more_moe_layouts_train_as_one_process(runs: Runs, name: str) -> None:
    _check(runs, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", RESHARDED)
def test_checkpoints_reshard_to_fsdp_alone_and_back(runs: Runs, name: str) -> None:
    kind, layout = LAYOUTS[name]
    runs.check_reshard(name, kind, layout)


THREE_AXES: dict[str, tuple[str, list[str]]] = {
    "builtin-pp2xtp2xep2": ("builtin", ["parallel.pp=2", "parallel.tp=2", "parallel.ep=2"]),
    "builtin-tp2xcp2xep2": ("builtin", ["parallel.tp=2", "parallel.cp=2", "parallel.ep=2"]),
    "builtin-pp2xtp2xcp2": ("builtin", ["parallel.pp=2", "parallel.tp=2", "parallel.cp=2"]),
}
EVERY_AXIS = ["parallel.pp=2", "parallel.tp=2", "parallel.cp=2", "parallel.ep=2"]
"""pp x tp x cp x ep x FSDP (16 ranks: the data ranks are 2, split by ep)."""
"""Three axes at once, 8 ranks (time-shared on this machine's cores): the built-in MoE,
each axis as in its pairs above."""


@pytest.mark.slow
@pytest.mark.parametrize("name", list(THREE_AXES))
def test_three_axes_at_eight_ranks_train_as_one_process(runs: Runs, name: str) -> None:
    kind, layout = THREE_AXES[name]
    got = runs.run(name, kind, layout, world=8)
    assert len(got["ranks"]) == 8
    assert "router load-balancing loss x 0.1" in got["ranks"][0]["loss_note"]
    far = assert_trains_as_one_process(got["ranks"], got["metrics"], runs.reference(kind))
    print(f"{name}: worst differences {far}")


@pytest.mark.slow
def test_every_axis_at_sixteen_ranks_trains_as_one_process(runs: Runs) -> None:
    got = runs.run("builtin-every-axis", "builtin", EVERY_AXIS, world=16)
    assert len(got["ranks"]) == 16
    far = assert_trains_as_one_process(got["ranks"], got["metrics"], runs.reference("builtin"))
    print(f"every axis: worst differences {far}")
