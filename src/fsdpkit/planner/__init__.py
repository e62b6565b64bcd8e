"""Know before launch what fits: per-rank memory, traffic and recommended settings.

    from fsdpkit.planner import plan, recommend, parse_device
    p = plan(cfg, world_size=64, device=parse_device("h100"))
    p.memory.peak.bytes, p.memory.peak.phase, p.fits

``analytic`` replays one FSDP2 step over the model's shapes (milliseconds at any
scale); ``traced`` runs the real model code under FakeTensorMode on a fake process
group (see [Note: traced planning]). The planner computes and never prints; the
``report`` module formats.
"""

from fsdpkit.devices import DEVICES, Device, DeviceError, parse_device, parse_size
from fsdpkit.planner.api import DEFAULT_MARGIN, plan, plan_scenario, usable_bytes
from fsdpkit.planner.errors import PlanError
from fsdpkit.planner.search.recommend import StepCost, recommend
from fsdpkit.planner.search.recommendation import Candidate, Recommendation
from fsdpkit.planner.shapes.result import CommVolume, MemoryPlan, PeakPoint, Plan
from fsdpkit.planner.shapes.scenario import Scenario, scenario

__all__ = [
    "DEFAULT_MARGIN",
    "DEVICES",
    "Candidate",
    "CommVolume",
    "Device",
    "DeviceError",
    "MemoryPlan",
    "PeakPoint",
    "Plan",
    "PlanError",
    "Recommendation",
    "Scenario",
    "StepCost",
    "parse_device",
    "parse_size",
    "plan",
    "plan_scenario",
    "recommend",
    "scenario",
    "usable_bytes",
]
