"""Doctor's checks of a mixture-of-experts model: what it routes, whether the router
is trained against collapse, and where FSDP puts the experts.

A MoE run can go wrong without an error: with the router loss off nothing stops the
router from sending every token to a few experts, and experts left outside the block
units sit in the root unit, gathered for the whole step. Dense models get no check.
"""

from __future__ import annotations

from torch import nn

from fsdpkit.config import RunConfig
from fsdpkit.doctor.check import Check, ok, warn
from fsdpkit.doctor.model import ROOT, param_table
from fsdpkit.loss.router import router_spec
from fsdpkit.models.experts import Experts, experts_of, fmt_count, is_routed


def expert_checks(model: nn.Module, units: list[list[nn.Module]], cfg: RunConfig) -> list[Check]:
    """The "experts" and "router loss" checks ([] for a dense model)."""
    experts = experts_of(model)
    if experts is None:
        return []
    return [_placement(model, units, cfg, experts), _router(model, cfg, experts)]


def _placement(
    model: nn.Module, units: list[list[nn.Module]], cfg: RunConfig, experts: Experts
) -> Check:
    table = param_table(model, units, edge_units=cfg.parallel.edge_units)
    in_root = sum(i.param.numel() for i in table if i.unit == ROOT and is_routed(i.name))
    what = experts.describe()
    if cfg.lora.rank:
        what += (
            "; LoRA adapts the linear layers only: the routers and the fused expert weights "
            "stay frozen unless lora.trainable names them"
        )
    if in_root:
        return warn(
            "experts",
            f"{what}; {fmt_count(in_root)} expert parameters are in no block unit, so the "
            "root unit keeps them gathered for the whole step",
            "add the MoE layer's class to parallel.block_classes",
        )
    ep = cfg.parallel.ep
    if ep > 1:  # fsdpkit.sharding.experts.parallel: units of their own, E / ep experts per rank
        return ok(
            "experts",
            f"{what}; parallel.ep = {ep}: each rank computes {experts.count // ep} experts of "
            "a block, an FSDP unit of their own over the data ranks without ep",
        )
    return ok("experts", f"{what}; every expert is sharded with its block's unit")


def _router(model: nn.Module, cfg: RunConfig, experts: Experts) -> Check:
    spec = router_spec(model, coef=cfg.model.router_aux_loss_coef)
    if spec is None or spec.aux_fn is None:
        return ok(
            "router loss",
            f"{experts.family} defines no router auxiliary loss; none is added",
        )
    if not spec.coef:
        return warn(
            "router loss",
            f"the router load-balancing loss is off (coefficient 0): nothing keeps the "
            f"{experts.count} experts' load balanced, and a router that collapses onto a few "
            "experts trains on without an error (watch expert_load_max in metrics.jsonl)",
            "set model.router_aux_loss_coef (transformers' families use 0.001 to 0.02)",
        )
    return ok(
        "router loss",
        f"load-balancing loss x {spec.coef:g} over each global micro-batch; metrics.jsonl "
        "logs aux_loss and expert_load_min / expert_load_max",
    )
