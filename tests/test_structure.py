"""The package stays in small pieces: limits on modules, classes, functions and folders.

Over `src/kvgate`: no module over 600 lines, no class with over 30 methods, no function
with over 7 parameters (`self` and `cls` not counted; `*args` and `**kwargs` count one
each), no package folder with over 14 modules (`*.py` files directly in it, `__init__.py`
included). A piece past a limit holds more than one idea: split it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "kvgate"
MAX_LINES = 600
MAX_METHODS = 30
MAX_PARAMS = 7
MAX_MODULES = 14


def _modules() -> Iterator[tuple[Path, str]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, path.read_text(encoding="utf-8")


def _where(path: Path, node: ast.AST | None = None) -> str:
    where = str(path.relative_to(PACKAGE.parent))
    return f"{where}:{node.lineno}" if isinstance(node, ast.stmt) else where


def _parameters(args: ast.arguments) -> int:
    named = (*args.posonlyargs, *args.args, *args.kwonlyargs)
    count = sum(1 for a in named if a.arg not in ("self", "cls"))
    return count + (args.vararg is not None) + (args.kwarg is not None)


def test_no_module_is_over_600_lines() -> None:
    long = [
        f"{_where(path)}: {text.count(chr(10))} lines"
        for path, text in _modules()
        if text.count("\n") > MAX_LINES
    ]
    assert not long, "\n".join(long)


def test_no_class_has_over_30_methods() -> None:
    big = []
    for path, text in _modules():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                methods = [
                    b for b in node.body if isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef)
                ]
                if len(methods) > MAX_METHODS:
                    big.append(f"{_where(path, node)} {node.name}: {len(methods)} methods")
    assert not big, "\n".join(big)


def test_no_function_takes_over_7_parameters() -> None:
    wide = []
    for path, text in _modules():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                count = _parameters(node.args)
                if count > MAX_PARAMS:
                    wide.append(f"{_where(path, node)} {node.name}: {count} parameters")
    assert not wide, "\n".join(wide)


def test_no_package_folder_holds_over_14_modules() -> None:
    folders = [PACKAGE, *(p.parent for p in PACKAGE.rglob("__init__.py"))]
    crowded = [
        f"{_where(folder)}: {count} modules"
        for folder in sorted(set(folders))
        if (count := len(list(folder.glob("*.py")))) > MAX_MODULES
    ]
    assert not crowded, "\n".join(crowded)


def test_the_checks_see_the_package() -> None:
    """The limits are checked over the real tree (a wrong path would pass them all)."""
    assert (PACKAGE / "__init__.py").exists()
    assert sum(1 for _ in _modules()) > 50
    func = ast.parse("def f(self, a, *b, c, **d): pass").body[0]
    assert isinstance(func, ast.FunctionDef) and _parameters(func.args) == 4
