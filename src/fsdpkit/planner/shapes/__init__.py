"""A run as numbers: what the replay, the trace and the search compute over.

scenario   one resolved training setup (config + world size -> numbers)
scenario_json  the scenario as `fsdpkit plan --json` writes it (keys kept stable)
mparallel  what a tp x cp layout divides and exchanges, and which are refused
states     model states per rank (parameters, gradients, AdamW) and early units
result     what a plan says: frozen dataclasses the planner fills
"""
