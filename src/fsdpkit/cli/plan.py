"""``fsdpkit plan``: per-rank memory, traffic and a fit verdict before launch.

    fsdpkit plan run.toml --world-size 64 --device-mem h100
    fsdpkit plan model.preset=llama3-8b data.seq_len=8192 train.micro_batch_size=2 \\
        activations.mode=full --world-size 8 --device-mem 80GiB
    fsdpkit plan run.toml --world-size 8 --device-mem h100 --trace      # run the real code
    fsdpkit plan run.toml --world-size 64 --device-mem a100-80gb --recommend
    fsdpkit plan run.toml --world-size 8 --device-mem 80GiB --json      # for scripts

Takes the same config as ``fsdpkit train``. ``--device-mem`` is a size (80GiB, 40GB),
a known device (h100, h200, a100-40gb, a100-80gb, l4, cpu, ...) or NAME:SIZE. The
exit code is 0 whenever a plan was made; read "fits" in the JSON to gate a launch.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from fsdpkit.cli.configargs import add_config_items, split_items
from fsdpkit.devices import DEFAULT_MARGIN, DEVICES, device_from

if TYPE_CHECKING:
    from fsdpkit.planner.experts.routing import Routing


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="per-rank memory and traffic of a config before launch; --recommend settings",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_items(p, example="as for fsdpkit train")
    p.add_argument("--world-size", type=int, default=1, help="ranks in the job (default 1)")
    p.add_argument(
        "--device-mem",
        default=None,
        metavar="SIZE|NAME",
        help=f"device memory: a size (80GiB) or a device ({', '.join(DEVICES)}); "
        "NAME:SIZE overrides the memory",
    )
    p.add_argument("--device", default=None, metavar="NAME", help="device name (same names)")
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=8,
        help="ranks per machine: hybrid shard_degree default, link speeds (default 8)",
    )
    p.add_argument(
        "--margin",
        type=float,
        default=DEFAULT_MARGIN,
        help=f"share of device memory kept free (default {DEFAULT_MARGIN})",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="run one fake step of the real code (automatic for models without an analytic plan)",
    )
    p.add_argument(
        "--moe-imbalance",
        default=None,
        metavar="X|RUN_DIR",
        help="mixture of experts under parallel.ep: plan the busiest ep rank receiving X "
        "times its balanced rows in every layer, or the routing a run directory recorded "
        "(moe_imbalance in its metrics.jsonl, median step); default: balanced",
    )
    p.add_argument("--recommend", action="store_true", help="search settings that fit")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # here, not at the top: `fsdpkit --help` imports every command's module
    from fsdpkit import config as configuration
    from fsdpkit.planner import plan
    from fsdpkit.planner.formatting import (
        format_plan,
        format_recommendation,
        plan_dict,
        recommendation_dict,
    )

    path, overrides = split_items(args.items)
    cfg = configuration.load(path, overrides)
    device = device_from(name=args.device, memory=args.device_mem)
    common: dict[str, Any] = {
        "world_size": args.world_size,
        "device": device,
        "ranks_per_node": args.ranks_per_node,
    }
    routing = _routing(args.moe_imbalance)
    result = plan(cfg, trace=args.trace or None, margin=args.margin, routing=routing, **common)
    rec = None
    if args.recommend:
        from fsdpkit.planner.search.recommend import recommend

        common.pop("device")
        rec = recommend(
            cfg, device=result.scenario.device, margin=args.margin, routing=routing, **common
        )
    if args.json:
        out: dict[str, Any] = {"plan": plan_dict(result)}
        if rec is not None:
            out["recommendation"] = recommendation_dict(rec)
        json.dump(out, sys.stdout, indent=2, default=str)
        print()
        return 0
    print(format_plan(result))
    if rec is not None:
        print()
        print(format_recommendation(rec))
        if not routing.balanced or routing.source:
            print(
                "note: the recommendation plans its options with ep > 1 at the same "
                "--moe-imbalance (a run's was measured at its own ep degree; at a larger "
                "one the busiest rank's share is usually larger); options without ep do "
                "not depend on it"
            )
    return 0


def _routing(value: str | None) -> Routing:
    """``--moe-imbalance``: a number, or a run directory whose metrics recorded one."""
    from fsdpkit.planner.experts.routing import BALANCED, uniform

    if value is None:
        return BALANCED
    try:
        number = float(value)
    except ValueError:
        from pathlib import Path

        from fsdpkit.observe.runlog import run_routing

        return run_routing(Path(value))
    return uniform(number)
