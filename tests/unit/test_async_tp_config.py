"""``parallel.async_tp``: refused by field without tensor parallelism or compile, and
on devices without CUDA, each with one paragraph naming the fix."""

from __future__ import annotations

import pytest

from fsdpkit.config import load
from fsdpkit.errors import ConfigError
from fsdpkit.sharding.compile import enable_async_tp


@pytest.mark.parametrize(
    ("overrides", "missing"),
    [
        (["train.compile=true"], "parallel.tp > 1 (got 1)"),
        (["parallel.tp=2"], "train.compile = true (got False)"),
    ],
)
def test_needs_tensor_parallelism_and_compiled_blocks(overrides: list[str], missing: str) -> None:
    with pytest.raises(ConfigError, match=r"parallel\.async_tp = true") as err:
        load(None, ["parallel.async_tp=true", *overrides])
    assert missing in str(err.value) and "parallel.async_tp = false" in str(err.value)


def test_accepted_with_both() -> None:
    cfg = load(None, ["parallel.async_tp=true", "parallel.tp=2", "train.compile=true"])
    assert cfg.parallel.async_tp


def test_refused_off_cuda_before_anything_is_compiled() -> None:
    import torch._inductor.config as inductor_config

    before = inductor_config._micro_pipeline_tp
    with pytest.raises(ConfigError, match="needs CUDA GPUs") as err:
        enable_async_tp(device_type="cpu")
    assert "'cpu'" in str(err.value)
    assert inductor_config._micro_pipeline_tp == before  # nothing changed
