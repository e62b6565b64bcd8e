"""``fsdpkit migrate``: from FSDP1 and Accelerate to fsdpkit.

Modules, each owning one thing:
    result            Migration / Setting / Dropped records, MigrateError
    fsdp1             FSDP1 settings in fsdpkit terms (shared by both converters)
    accelerate        Accelerate config (YAML/JSON) -> Migration
    spec              FSDP1 constructor arguments (JSON, dict literal, FSDP(...) call) -> Migration
    render            Migration -> commented TOML, checked with fsdpkit.config
"""

from fsdpkit.migrate.accelerate import convert_accelerate
from fsdpkit.migrate.render import render, validate
from fsdpkit.migrate.result import Dropped, MigrateError, Migration, Setting
from fsdpkit.migrate.spec import convert_fsdp1, parse_spec

__all__ = [
    "Dropped",
    "MigrateError",
    "Migration",
    "Setting",
    "convert_accelerate",
    "convert_fsdp1",
    "parse_spec",
    "render",
    "validate",
]
