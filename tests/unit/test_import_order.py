"""The wings import one way: every import in ``coordlfs/`` (at module level, inside functions
and under ``TYPE_CHECKING`` alike) names a module of its own wing or of a wing it may use, and
no modules import each other in a circle. Read from the source with ``ast``, nothing imported.

The order is the one ``docs/architecture.md`` draws and each wing's ``__init__.py`` states; a
failure names the file, the line and the wings, so that an upward import is seen where it is
written (a lower wing that must call up takes a callable or an object it is handed instead).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[2] / "coordlfs"

#: Modules at the top of the package, by wing: the base every wing may use, the command, and
#: the job side's modules that users and fsspec's entry point name by these paths.
TOP = {"__init__": "base", "errors": "base", "sizes": "base",
       "cli": "cli", "__main__": "cli",
       "control": "client", "torch": "client", "fsspec_fs": "client", "webdataset": "client"}

_PRODUCT = ("system", "source", "protocol", "cache", "jobs", "peers", "fs", "daemon", "client")
#: The wings each wing may import besides its own, bottom up.
MAY_IMPORT: dict[str, set[str]] = {
    "base": set(),
    "system": {"base"},
    "source": {"system", "base"},
    "protocol": {"system", "base"},
    "cache": {"protocol", "source", "system", "base"},
    "jobs": {"cache", "protocol", "source", "system", "base"},
    "peers": {"cache", "protocol", "source", "system", "base"},
    "fs": {"peers", "jobs", "cache", "protocol", "source", "system", "base"},
    "daemon": {"fs", "peers", "jobs", "cache", "protocol", "source", "system", "base"},
    "client": {"cache", "protocol", "source", "system", "base"},
    "testbed": {*_PRODUCT, "base"},
    "bench": {"testbed", *_PRODUCT, "base"},
    "cli": {"bench", "testbed", *_PRODUCT, "base"},
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def wing_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "base"
    return TOP.get(parts[1], "base") if len(parts) == 2 and parts[1] in TOP else parts[1]


def imported(tree: ast.AST, module: str, is_package: bool, root: Path) -> list[tuple[int, str]]:
    """(line, module) of every coordlfs module ``tree`` imports; ``from P import N`` counts
    as importing ``P.N`` when that is a module, else ``P``."""
    package = root.name
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names
                      if a.name.split(".")[0] == package]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if is_package else module.split(".")[:-1]
                here = here[:len(here) - node.level + 1]
                base = ".".join([*here, base] if base else here)
            if base.split(".")[0] != package:
                continue
            for a in node.names:
                sub = root.parent.joinpath(*f"{base}.{a.name}".split("."))
                exists = sub.with_suffix(".py").is_file() or sub.is_dir()
                found.append((node.lineno, f"{base}.{a.name}" if exists else base))
    return found


def check(root: Path) -> tuple[list[str], list[list[str]]]:
    """The imports against the order (``file:line: ...``) and the circles of modules."""
    wrong, graph = [], {}
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        wing = wing_of(module)
        edges = imported(ast.parse(path.read_text(), str(path)), module,
                         path.name == "__init__.py", root)
        graph[module] = {target for _line, target in edges if target != module}
        for line, target in edges:
            other = wing_of(target)
            if other != wing and other not in MAY_IMPORT[wing]:
                wrong.append(f"{path.relative_to(root.parent)}:{line}: {module} ({wing}) imports "
                             f"{target} ({other}), which {wing} may not use")
    return wrong, circles(graph)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in graph:
                continue
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_import_follows_the_order_of_the_wings():
    wrong, _circles = check(PACKAGE)
    assert not wrong, "imports against the order of the wings:\n" + "\n".join(wrong)


def test_no_modules_import_each_other_in_a_circle():
    _wrong, found = check(PACKAGE)
    assert not found, f"modules in a circle: {found}"


def test_every_directory_of_the_package_is_a_wing_with_its_rules():
    wings = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert wings <= set(MAY_IMPORT)
    for wing in wings - {"bench", "testbed"}:
        doc = ast.get_docstring(ast.parse((PACKAGE / wing / "__init__.py").read_text()))
        assert doc and "May import" in doc, f"coordlfs/{wing}/__init__.py: no 'May import'"
    assert {path.stem for path in PACKAGE.glob("*.py")} <= set(TOP)


UPWARD = "coordlfs/cache/low.py:3: coordlfs.cache.low (cache) imports coordlfs.fs.inodes (fs)"


@pytest.mark.parametrize("line, expected", [("from coordlfs.fs.inodes import Key", UPWARD),
                                            ("    from ..fs import inodes", UPWARD)])
def test_an_upward_import_is_named_by_file_and_line(tmp_path, line, expected):
    """Also one in a function or under TYPE_CHECKING, written absolute or relative."""
    root = tmp_path / "coordlfs"
    for wing in ("cache", "fs"):
        (root / wing).mkdir(parents=True)
        (root / wing / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "fs" / "inodes.py").write_text("from coordlfs.cache import low\n")
    indent = line.startswith(" ")
    (root / "cache" / "low.py").write_text(
        ("if TYPE_CHECKING:\n    pass\n" if indent else "import os\n\n") + line + "\n")
    wrong, found = check(root)
    assert [w.split(", which")[0] for w in wrong] == [expected]
    assert found == [["coordlfs.cache.low", "coordlfs.fs.inodes"]]
