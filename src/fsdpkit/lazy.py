"""A package face that imports its public names on first use (PEP 562).

[Note: lazy package faces]
Importing ``fsdpkit.x.y`` runs ``fsdpkit/__init__.py`` and ``fsdpkit/x/__init__.py``
first. When those re-export the whole library eagerly, every command pays for torch,
FSDP2, DTensor and sympy (~2 s) before it parses argv: ``fsdpkit --help`` took longer
than ``python -c "import torch"``. A face built with ``lazy_exports`` imports a name's
module only when the name is looked up, so a caller pays for what it uses.

A face writes its public names once, in ``_HOMES`` (name -> module); ``__all__`` is
``sorted(_HOMES)``. Type checkers cannot run that, so the face also imports each name
from its home under ``if TYPE_CHECKING:``, in the explicit re-export form ``import X as
X`` (public to mypy and pyright whatever ``__all__`` holds); tests/unit/test_lazy_faces.py
checks that those imports name exactly ``_HOMES``, module for module.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, homes: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: each public name is imported from
    its module in ``homes`` (name -> module) the first time it is asked for, then kept
    in the package's namespace."""

    def getattr_(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        setattr(sys.modules[package], name, value)  # later look-ups skip this function
        return value

    def dir_() -> list[str]:
        return sorted({*vars(sys.modules[package]), *homes})

    return getattr_, dir_
