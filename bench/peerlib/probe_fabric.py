"""What Lightning Fabric does on CPU: FSDPStrategy refuses it; ModelParallelStrategy with
its default mesh sizes does not shard. Rank 0 writes JSON to $PEERS_PROBE_OUT."""

from __future__ import annotations

import json
import os

from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy

from peerlib import common
from peerlib.impl_fabric import parallelize


def main() -> None:
    result: dict[str, object] = {}
    try:
        Fabric(accelerator="cpu", devices=2, strategy="fsdp")
        result["FSDPStrategy"] = "accepted"
    except Exception as exc:  # what a user sees
        result["FSDPStrategy"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    strategy = ModelParallelStrategy(parallelize_fn=parallelize)  # default sizes ("auto")
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = fabric.setup(common.build_model(common.Spec()))
    mesh = strategy.device_mesh
    result["ModelParallelStrategy defaults"] = {
        "mesh": dict(zip(mesh.mesh_dim_names or (), mesh.mesh.shape)),
        "shard_fraction": common.local_shard_fraction(model),
    }
    if fabric.global_rank == 0:
        with open(os.environ["PEERS_PROBE_OUT"], "w") as f:
            json.dump(result, f)
    common.finish()


if __name__ == "__main__":
    main()
