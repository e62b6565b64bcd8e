"""``fsdpkit migrate``: from FSDP1 and Accelerate to fsdpkit.

Modules, each owning one thing:
    outcome           Migration / Setting / Dropped records, MigrateError
    fsdp1_args        FSDP1 settings in fsdpkit terms (shared by both converters)
    accelerate/       Accelerate config (YAML/JSON) -> Migration
    spec              FSDP1 constructor arguments (JSON, dict literal, FSDP(...) call) -> Migration
    render            Migration -> commented TOML, checked with fsdpkit.config
    fsdp1_checkpoint  FSDP1 SHARDED_STATE_DICT / FULL_STATE_DICT -> a sharded model (init_from)
"""

from fsdpkit.checkpoint.fsdp1 import detect, load_fsdp1_checkpoint
from fsdpkit.migrate.accelerate.config import convert_accelerate
from fsdpkit.migrate.outcome import Dropped, MigrateError, Migration, Setting
from fsdpkit.migrate.render import render, validate
from fsdpkit.migrate.spec import convert_fsdp1, parse_spec

__all__ = [
    "Dropped",
    "MigrateError",
    "Migration",
    "Setting",
    "convert_accelerate",
    "convert_fsdp1",
    "detect",
    "load_fsdp1_checkpoint",
    "parse_spec",
    "render",
    "validate",
]
