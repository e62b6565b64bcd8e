"""Model states per rank (sharded parameters, gradients, AdamW states) and the block
units that run before anything trainable: what the analytic and traced plans and the
recommender share."""

from __future__ import annotations

from fsdpkit.planner.shapes.scenario import Scenario


def leading_frozen_units(sc: Scenario) -> int:
    """Block units that run before anything trainable (fine-tuning with a frozen
    embedding): nothing in them needs a gradient, so autograd saves nothing there and
    backward never reaches them (FSDP2 does not unshard them again)."""
    if "embedding" not in sc.layout.frozen_names:
        return 0
    return next((j for j, u in enumerate(sc.units) if u.grads_numel), len(sc.units))


def model_states(sc: Scenario) -> dict[str, int]:
    """Sharded parameters, gradients and AdamW states per rank: 4 + 4 + 8 bytes per
    (padded) local parameter element — ZeRO's 16 bytes per parameter / shard degree.
    Frozen parameters (fine-tuning) keep only their stored bytes: no gradient, no
    optimizer state (fsdpkit.planner.model.finetune_layout)."""
    units = sc.all_units
    trainable = sum(u.grads_sharded for u in units)
    return {
        "sharded_params": sum(u.sharded_param_bytes for u in units),
        "gradients": 4 * trainable,
        "optimizer_states": 8 * trainable,
    }


def stages_states(stages: list[Scenario], *, twin: int = 0) -> dict[str, int]:
    """The model states of a pipeline rank's stages at the optimizer step; ``twin``: the
    sharded elements of a tied head's copy the rank's optimizer does not step (no
    optimizer state: [Note: tied stages in the plan])."""
    states: dict[str, int] = {"optimizer_states": -8 * twin}
    for sc in stages:
        for key, value in model_states(sc).items():
            states[key] = states.get(key, 0) + value
    return states
