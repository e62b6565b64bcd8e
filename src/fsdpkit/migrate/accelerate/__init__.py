"""Accelerate configs into fsdpkit settings.

config    an Accelerate YAML config read, its FSDP and parallelism sections routed
fsdp      its ``fsdp_config`` (FSDP1 or FSDP2 keys)
parallelism  its ``parallelism_config`` (tp / cp / sp sizes)
"""
