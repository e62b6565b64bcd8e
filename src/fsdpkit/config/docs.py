"""``fsdpkit train --help-config``: every key with its type, default and docstring.

The docstrings are the string literals written under each field in ``schema``; they
are read from the source with ``ast`` so the documentation lives beside the field.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import textwrap
import typing
from functools import cache

from fsdpkit.config.coerce import type_name
from fsdpkit.config.schema import SECTIONS, RunConfig
from fsdpkit.config.toml import toml_value


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under each field of a config dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def describe() -> str:
    """Every section and field with its type, default and doc (for --help-config)."""
    defaults = RunConfig().to_dict()
    out = []
    for section, cls in SECTIONS.items():
        out.append(f"[{section}]")
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        for key, tp in hints.items():
            default = defaults[section][key]
            shown = "(empty)" if default is None else toml_value(default)
            out.append(f"  {section}.{key} = {shown}    ({type_name(tp)})")
            out.append(f"      {docs.get(key, '')}")
        out.append("")
    return "\n".join(out)
