"""torch's pipelining schedule over a rank's stages ([Note: pipeline schedules] in
fsdpkit.config.schedules): its ``PipelineStage`` per stage module, told which
micro-batch it runs, and the schedule class the run names."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdpkit.config.schedules import SCHEDULES
from fsdpkit.sharding.pipeline.split import StageSplit


def _loss_is_output(output: torch.Tensor, _target: Any) -> torch.Tensor:
    """The schedule's loss function: the last stage's output is its loss already."""
    return output


def _stage_class() -> type:
    """torch's PipelineStage telling its stage module which micro-batch it runs."""
    from torch.distributed.pipelining import PipelineStage

    class _Stage(PipelineStage):  # type: ignore[misc]
        def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            self.submod.micro_batch = fwd_chunk_id  # type: ignore[assignment]
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    return _Stage


def torch_schedule(
    name: str,
    stages: Sequence[nn.Module],
    *,
    split: StageSplit,
    group: DeviceMesh,
    device: torch.device,
    n: int,
) -> Any:
    """torch's schedule ``name`` over this rank's stages (``StageModule``s of
    fsdpkit.sharding.pipeline.stages)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    stage_cls = _stage_class()
    made = [stage_cls(m, m.stage, split.stages, device, group=group.get_group()) for m in stages]
    schedule_cls = get_schedule_class(name)
    first = made if SCHEDULES[name].looped else made[0]
    return schedule_cls(first, n_microbatches=n, loss_fn=_loss_is_output, scale_grads=False)
