"""``fsdpkit migrate`` as users run it: an Accelerate config to a TOML file (warnings on
stderr) that loads as an fsdpkit config (the --fsdp1 path: tests/unit/test_migrate.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from clirun import fsdpkit

from fsdpkit import config as configuration

pytestmark = pytest.mark.e2e

CONFIGS = Path(__file__).parent.parent / "unit" / "accelerate_configs"


def test_accelerate_config_to_toml_file(tmp_path: Path) -> None:
    out = tmp_path / "run.toml"
    result = fsdpkit("migrate", str(CONFIGS / "contradictory.yaml"), "-o", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == ""
    warnings = [ln for ln in result.stderr.splitlines() if "warning: conflict:" in ln]
    assert len(warnings) == 3
    assert "wrote" in result.stderr and "run.toml" in result.stderr
    cfg = configuration.load(out)
    assert cfg.parallel.strategy == "full" and cfg.offload.params is True
    assert (
        "# Launch: CUDA_VISIBLE_DEVICES=0,1,2,3 fsdpkit train run.toml --nproc 4" in out.read_text()
    )
