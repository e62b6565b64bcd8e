"""What each command imports ([Note: lazy package faces] in fsdpkit.lazy): cheap
commands do not import what they never use (the faces themselves:
tests/unit/test_lazy_faces.py).

Time itself is measured outside the tests (paired runs against ``import torch``); here
the facts that make it fast are checked in a fresh interpreter: which modules end up in
``sys.modules``.
"""

from __future__ import annotations

import json
import subprocess
import sys


def _loaded(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_help_and_the_parser_import_no_torch() -> None:
    loaded = _loaded("import fsdpkit.cli; fsdpkit.cli.build_parser(); import fsdpkit")
    assert "torch" not in loaded
    assert {"fsdpkit.cli.plan", "fsdpkit.cli.ckpt", "fsdpkit.cli.train"} <= loaded


def test_plan_of_a_preset_imports_neither_dynamo_nor_the_checkpointer() -> None:
    """A 405B preset is planned from formulas on a meta model: no torch._dynamo (a meta
    nn.Embedding's normal_ and RoPE's arange imported it, ~0.5 s), no checkpoint
    writer (the checkpoint face imported DCP's planners for the staging rule), and
    neither DTensor (with sympy, ~0.5 s: the tp / cp rules lived beside the styles that
    apply them), FSDP2 nor DCP (the HF directory checks lived beside the weight reader)."""
    code = (
        "import contextlib, io\n"
        "from fsdpkit.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['plan', 'model.preset=llama3-405b', '--world-size', '1024',"
        " '--device-mem', 'h100'])"
    )
    loaded = _loaded(code)
    assert "fsdpkit.planner.replay.analytic" in loaded
    heavy = (
        "torch._dynamo",
        "fsdpkit.checkpoint.checkpointer",
        "torch.distributed.tensor",
        "torch.distributed.fsdp",
        "torch.distributed.checkpoint",
    )
    assert not [m for m in heavy if m in loaded]
