"""The one base class of errors that are the user's to fix.

The CLI prints such an error as one paragraph (no traceback) and exits non-zero.
Subsystems subclass it (ConfigError, MeshError, DataError, CheckpointError...).
"""


class UserError(Exception):
    """Bad input: the message says what is wrong, where, and what to do."""


class ConfigError(UserError, ValueError):
    """A config value is wrong; the message names the key and the fix."""
