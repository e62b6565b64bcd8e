"""The architecture's layer list holds: every import goes to the importer's own layer or
one below it, imports inside functions included, and no two files import each other,
directly or round about. The list is the fenced block after ``<!-- layers -->`` in
docs/architecture.md (the README points there), top layer first, one layer a line: the
names of its packages and top-level modules, then two or more spaces, then what the
layer does.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "fsdpkit"


def _layers() -> dict[str, int]:
    """Top-level name -> layer index (0 = top) from docs/architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- layers -->\s*```text\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no '<!-- layers -->' block and ```text fence"
    out: dict[str, int] = {}
    for index, line in enumerate(ln for ln in block.group(1).splitlines() if ln.strip()):
        names = re.split(r"\s{2,}", line.strip())[0].split()
        for name in names:
            assert name not in out, f"{name} is listed in two layers"
            out[name.rstrip("/")] = index
    return out


def _module(file: Path) -> str:
    parts = list(file.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top(module: str) -> str:
    """The layer-list name of a module: its sub-package or top-level module, and
    ``__init__`` for the package face itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(file: Path, module: str) -> set[str]:
    """Every fsdpkit module ``file`` imports (also inside functions; not under
    ``if TYPE_CHECKING``, which never runs)."""
    tree = ast.parse(file.read_text(encoding="utf-8"))
    package = module if file.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.split(".")[0] == "fsdpkit")
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join([*up, base] if base else up)
                if base.split(".")[0] == "fsdpkit":
                    found.update(f"{base}.{a.name}" for a in child.names)
                    found.add(base)
            visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module(f): f for f in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for module, file in files.items():
        for target in _imports(file, module):
            while target not in files and "." in target:
                target = target.rsplit(".", 1)[0]
            if target == module or target not in files:
                continue
            if target == "fsdpkit" or module.startswith(target + "."):
                continue  # a module importing its own package's face
            graph[module].add(target)
        graph.setdefault(module, set())
    return graph


def test_every_package_is_in_exactly_one_listed_layer() -> None:
    layers = _layers()
    present = {_top(m) for m in _graph()}
    assert present - set(layers) == set(), "add these to the layer list in docs/architecture.md"
    assert set(layers) - present == set(), "docs/architecture.md lists names that no longer exist"


def test_imports_go_only_to_the_same_layer_or_below() -> None:
    layers = _layers()
    upward = [
        f"{a} (layer {layers[_top(a)]}) imports {b} (layer {layers[_top(b)]})"
        for a, targets in _graph().items()
        for b in sorted(targets)
        if layers[_top(b)] < layers[_top(a)]
    ]
    assert upward == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = [stack.pop()]
            while members[-1] != v:
                members.append(stack.pop())
            if len(members) > 1:
                cycles.append(sorted(members))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return cycles


def test_no_two_files_import_each_other() -> None:
    assert _cycles(_graph()) == []


MAX_LINES = 400
"""shared/style.md: modules under ~400 lines (one concept per module); a file past it is
split by concept, not trimmed by packing lines."""


def test_every_module_stays_within_the_size_rule() -> None:
    sizes = {f: len(f.read_text(encoding="utf-8").splitlines()) for f in PACKAGE.rglob("*.py")}
    over = {str(f.relative_to(ROOT)): n for f, n in sizes.items() if n > MAX_LINES}
    assert over == {}, f"modules over {MAX_LINES} lines: {over}"


AXES = ("tensor", "context", "experts", "pipeline")
"""The parallelism axes: one folder each under sharding/ (and at most one under
planner/ and trainable/); shared/design.md, "Parallelism axes"."""
AXIS_WORDS = {
    "tensor": ("tensor",),
    "context": ("context", "ring", "ulysses"),
    "experts": ("experts", "dispatch"),
    "pipeline": ("pipeline", "zerobubble"),
}
"""The file-name words that say a module belongs to an axis."""
ROLE_NAMES = {"__init__.py", "errors.py"}
"""Names every package may have: its face and its own error types."""


def _in_axis_folder(file: Path) -> bool:
    parts = file.relative_to(PACKAGE).parts
    return len(parts) >= 3 and parts[1] in AXES


def test_three_files_sharing_a_prefix_are_a_folder() -> None:
    """``tensor_rules``, ``tensor_edges``, ``tensor_sequence`` are ``tensor/{rules,edges,
    sequence}``: a family of files is a folder."""
    families: dict[tuple[Path, str], list[str]] = defaultdict(list)
    for file in PACKAGE.rglob("*.py"):
        if file.name != "__init__.py":
            families[(file.parent, file.stem.split("_")[0])].append(file.stem)
    crowded = {
        f"{folder.relative_to(ROOT)}/{prefix}_*": sorted(stems)
        for (folder, prefix), stems in families.items()
        if len(stems) >= 3
    }
    assert crowded == {}, "make each family a folder"


def test_no_two_modules_share_a_file_name_outside_axis_folders() -> None:
    """Four modules named ``pipeline.py`` in four packages meant one concept smeared over
    the house. cli/'s modules are named after their subcommand (Accelerate's layout), so
    they may repeat a library module's name."""
    seen: dict[str, list[str]] = defaultdict(list)
    for file in PACKAGE.rglob("*.py"):
        parts = file.relative_to(PACKAGE).parts
        if file.name in ROLE_NAMES or _in_axis_folder(file) or parts[0] == "cli":
            continue
        seen[file.name].append(str(file.relative_to(PACKAGE)))
    assert {name: where for name, where in seen.items() if len(where) > 1} == {}


def test_each_axis_is_one_folder_under_sharding_and_at_most_one_under_planner() -> None:
    for package in ("sharding", "planner", "trainable"):
        for axis, words in AXIS_WORDS.items():
            stray = [
                str(f.relative_to(PACKAGE))
                for f in (PACKAGE / package).rglob("*.py")
                if f.stem.split("_")[0] in words
                and f.relative_to(PACKAGE / package).parts[0] != axis
            ]
            assert stray == [], f"move these into {package}/{axis}/"
    for axis in AXES:
        assert (PACKAGE / "sharding" / axis / "__init__.py").is_file(), f"sharding/{axis}/"
