"""The package faces built with ``lazy_exports`` ([Note: lazy package faces] in
fsdpkit.lazy): each writes its public names once, in ``_HOMES``; ``__all__`` is derived
from it, the ``TYPE_CHECKING`` imports type checkers read name exactly the same names
from the same modules, and every name resolves to its home's object.

The faces are found by reading the source, so a new one is checked without a list here.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def _faces() -> list[str]:
    """Every package whose ``__init__`` calls ``lazy_exports``."""
    found = []
    for init in sorted(SRC.glob("fsdpkit/**/__init__.py")):
        if "lazy_exports(__name__" in init.read_text():
            found.append(".".join(init.parent.relative_to(SRC).parts))
    return found


FACES = _faces()


def _type_checking_imports(face: str) -> dict[str, str]:
    """name -> module of the imports under the face's ``if TYPE_CHECKING:``, each in
    the explicit re-export form ``from M import X as X``."""
    path = SRC.joinpath(*face.split("."), "__init__.py")
    tree = ast.parse(path.read_text())
    blocks = [
        n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    ]
    assert len(blocks) == 1, f"{path}: one `if TYPE_CHECKING:` block"
    names: dict[str, str] = {}
    for node in blocks[0].body:
        assert isinstance(node, ast.ImportFrom) and node.module, ast.unparse(node)
        for alias in node.names:
            assert alias.asname == alias.name, f"{path}: {ast.unparse(node)} is not `X as X`"
            assert alias.name not in names, f"{path}: {alias.name} imported twice"
            names[alias.name] = node.module
    return names


def test_the_faces_are_found() -> None:
    assert {"fsdpkit", "fsdpkit.sharding", "fsdpkit.checkpoint", "fsdpkit.rollout"} <= set(FACES)


@pytest.mark.parametrize("face", FACES)
def test_type_checking_imports_name_the_homes_module_for_module(face: str) -> None:
    homes = importlib.import_module(face)._HOMES
    assert _type_checking_imports(face) == homes


@pytest.mark.parametrize("face", FACES)
def test_every_public_name_resolves_from_its_home(face: str) -> None:
    module = importlib.import_module(face)
    homes = module._HOMES
    assert set(module.__all__) - {"__version__"} == set(homes)
    assert module.__all__ == sorted(module.__all__)
    for name in module.__all__:
        value = getattr(module, name)
        assert value is not None, name
        assert name in dir(module)
        if name in homes:
            assert value is getattr(importlib.import_module(homes[name]), name), name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        module.nope  # noqa: B018
