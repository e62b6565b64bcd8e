"""Mixture-of-experts in the plan (``parallel.ep``: the axis's one planner folder).

parallel  the units ``shard()`` builds under ep, the dispatch's traffic, the bound
          a real step's routing can reach
routing   [Note: routing in the plan]: the routing a plan assumes
routed    [Note: routed activations in the plan]: what a plan says beyond its peak
"""
