"""Rooms a newcomer can read whole: in the product's wings no class is over 450 lines and no
function over 60 (issue 32). The benchmarks and the testbed are tools, not the product."""

from __future__ import annotations

import ast
from pathlib import Path

import coordlfs

MAX_CLASS = 450
MAX_FUNCTION = 60
PACKAGE = Path(coordlfs.__file__).parent
#: wings outside the product
OUTSIDE = ("bench", "testbed")


def _too_long() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] in OUTSIDE:
            continue
        tree = ast.parse(path.read_text(), str(path))
        found += _walk(tree, relative.as_posix(), "")
    return found


def _walk(node: ast.AST, file: str, prefix: str) -> list[str]:
    found = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + child.name
            limit = MAX_CLASS if isinstance(child, ast.ClassDef) else MAX_FUNCTION
            length = child.end_lineno - child.lineno + 1
            if length > limit:
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                found.append(f"{file}: {kind} {name} is {length} lines (at most {limit})")
            found += _walk(child, file, name + ".")
        else:
            found += _walk(child, file, prefix)
    return found


def test_no_class_or_function_is_too_long() -> None:
    assert _too_long() == []
