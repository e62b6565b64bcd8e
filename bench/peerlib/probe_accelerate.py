"""What Accelerate does with an FSDP2 plugin on CPU as shipped (2 ranks, no workaround):
rank 0 writes JSON to $PEERS_PROBE_OUT. See [Note: Accelerate on CPU] in impl_accelerate."""

from __future__ import annotations

import json
import os

from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.state import AcceleratorState, PartialState

from peerlib import common


def _plugin() -> FullyShardedDataParallelPlugin:
    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=[common.block_class().__name__],
    )


def _try(cpu: bool) -> dict[str, object]:
    spec = common.Spec()
    accelerator = Accelerator(cpu=cpu, fsdp_plugin=_plugin())
    model = common.build_model(spec)
    model, _ = accelerator.prepare(model, common.adamw(model, spec))
    seen = {
        "distributed_type": str(accelerator.distributed_type),
        "process": f"{accelerator.process_index} of {accelerator.num_processes}",
        "model": type(model).__name__,
        "shard_fraction": common.local_shard_fraction(model),
    }
    AcceleratorState._reset_state(True)
    PartialState._reset_state()
    return seen


def main() -> None:
    rank = int(os.environ["RANK"])
    result = {"without cpu=True": _try(False), "with cpu=True": _try(True)}
    if rank == 0:
        with open(os.environ["PEERS_PROBE_OUT"], "w") as f:
            json.dump(result, f)
    common.finish()


if __name__ == "__main__":
    main()
