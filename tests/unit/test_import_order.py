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

#: The modules at the top of the package named here: the base every wing may use, and the
#: command. Any other module there must be a public path that only re-exports one wing's
#: modules (``reexported``), and belongs to that wing; one that does not is named as in none.
BASE = {"__init__", "errors", "sizes"}
COMMAND = {"cli", "__main__"}

_PRODUCT = ("system", "source", "protocol", "models", "cache", "jobs", "peers", "fs", "daemon",
            "client")
#: The wings each wing may import besides its own, bottom up.
MAY_IMPORT: dict[str, set[str]] = {
    "base": set(),
    "system": {"base"},
    "source": {"system", "base"},
    "protocol": {"system", "base"},
    "models": {"base"},
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


def wing_of(module: str, top: dict[str, str | None]) -> str | None:
    """The wing of a module; ``top`` gives those at the top of the package (``top_wings``)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "base"
    return top[parts[1]] if len(parts) == 2 and parts[1] in top else parts[1]


def reexported(tree: ast.Module, package: str) -> set[str]:
    """The modules of ``package`` a module re-exports, when its body is only that: a docstring,
    imports and ``__all__``; else (it does anything of its own) none."""
    modules = set()
    for i, node in enumerate(tree.body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == package:
            modules.add(node.module)
            continue
        if isinstance(node, ast.Assign) and \
                [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
            continue
        return set()
    return modules


def top_wings(root: Path) -> dict[str, str | None]:
    """The wing of each module at the top of the package: the base, the command, or the one
    wing whose modules it re-exports; None for any other (a module that belongs nowhere)."""
    top: dict[str, str | None] = {name: "base" for name in BASE}
    top |= {name: "cli" for name in COMMAND}
    for path in sorted(root.glob("*.py")):
        if path.stem not in top:
            sources = reexported(ast.parse(path.read_text(), str(path)), root.name)
            wings = {m.split(".")[1] for m in sources
                     if len(m.split(".")) > 2 and (root / m.split(".")[1]).is_dir()}
            top[path.stem] = wings.pop() if len(wings) == 1 and len(sources) else None
    return top


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
    """The imports against the order (``file:line: ...``), with any module at the top of the
    package in no wing, and the circles of modules."""
    top = top_wings(root)
    wrong = [f"{root.name}/{name}.py: at the top of the package, neither the base, the command "
             "nor a re-export of one wing" for name, wing in top.items() if wing is None]
    graph = {}
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        wing = wing_of(module, top)
        edges = imported(ast.parse(path.read_text(), str(path)), module,
                         path.name == "__init__.py", root)
        graph[module] = {target for _line, target in edges if target != module}
        if wing is None:
            continue
        for line, target in edges:
            other = wing_of(target, top)
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
    assert None not in top_wings(PACKAGE).values(), "a module at the top of the package in no wing"


def test_the_public_paths_at_the_top_belong_to_the_wings_they_re_export():
    top = top_wings(PACKAGE)
    assert {name: top[name] for name in ("control", "torch", "fsspec_fs", "webdataset")} == {
        "control": "protocol", "torch": "client", "fsspec_fs": "client", "webdataset": "client"}


UPWARD = "coordlfs/cache/low.py:3: coordlfs.cache.low (cache) imports coordlfs.fs.inodes (fs)"


def _two_wings(tmp_path: Path) -> Path:
    """A package ``coordlfs`` with the wings cache and fs, empty."""
    root = tmp_path / "coordlfs"
    for wing in ("cache", "fs"):
        (root / wing).mkdir(parents=True)
        (root / wing / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    return root


@pytest.mark.parametrize("line, expected", [("from coordlfs.fs.inodes import Key", UPWARD),
                                            ("    from ..fs import inodes", UPWARD)])
def test_an_upward_import_is_named_by_file_and_line(tmp_path, line, expected):
    """Also one in a function or under TYPE_CHECKING, written absolute or relative."""
    root = _two_wings(tmp_path)
    (root / "fs" / "inodes.py").write_text("from coordlfs.cache import low\n")
    indent = line.startswith(" ")
    (root / "cache" / "low.py").write_text(
        ("if TYPE_CHECKING:\n    pass\n" if indent else "import os\n\n") + line + "\n")
    wrong, found = check(root)
    assert [w.split(", which")[0] for w in wrong] == [expected]
    assert found == [["coordlfs.cache.low", "coordlfs.fs.inodes"]]


def test_a_module_at_the_top_is_a_re_export_of_one_wing_or_belongs_nowhere(tmp_path):
    """A re-export is in the wing it re-exports (and imported as that wing); a module at the
    top with code of its own, or re-exporting two wings, is in none, and named."""
    root = _two_wings(tmp_path)
    (root / "fs" / "inodes.py").write_text("Key = int\n")
    (root / "cache" / "low.py").write_text("X = 1\n")
    (root / "public.py").write_text('"""Doc."""\n\nfrom __future__ import annotations\n\n'
                                    'from coordlfs.fs.inodes import Key\n\n__all__ = ["Key"]\n')
    (root / "stray.py").write_text("from coordlfs.cache.low import X\n\nY = X + 1\n")
    (root / "both.py").write_text("from coordlfs.cache.low import X\n"
                                  "from coordlfs.fs.inodes import Key\n")
    (root / "cache" / "user.py").write_text("from coordlfs.public import Key\n")
    assert {k: v for k, v in top_wings(root).items() if k not in BASE | COMMAND} == {
        "public": "fs", "stray": None, "both": None}
    wrong, _found = check(root)
    assert [w.split(", which")[0] for w in wrong] == [
        "coordlfs/both.py: at the top of the package, neither the base, the command nor a "
        "re-export of one wing",
        "coordlfs/stray.py: at the top of the package, neither the base, the command nor a "
        "re-export of one wing",
        "coordlfs/cache/user.py:1: coordlfs.cache.user (cache) imports coordlfs.public (fs)"]
