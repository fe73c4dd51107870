"""The docs' tables of error codes and refusal reasons, checked against the code both ways.

Every table of README.md and docs/*.md with a `code`, `reason` or `X-Kvgate-Reason`
column names codes in backticks there. Each must be one the code writes, and every code
the code writes must be in one of them. The codes written are read from the source
(kvgate.gateway and kvgate.core, whatever their module layout): the `code` of each
`GatewayError` and of the connection guard's raw errors, the 403 codes of the admin
routes, the `reason` of each refusal the core makes, and the string constants those
arguments are made of.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "src/kvgate/gateway", ROOT / "src/kvgate/core"]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = re.compile(r"^[a-z][a-z0-9_]*$")

#: Callables whose argument (by position, or by keyword) is an error code or a reason.
CARRIERS = {
    "GatewayError": (2, "code"),
    "raw_error": (2, "code"),
    "_refuse": (2, "code"),
    "_bad": (2, "code"),
    "_unauthorized": (1, "code"),
    "AdminAccess": (2, "closed_code"),
    "Reject": (1, "reason"),
    "_refusal": (0, "reason"),
    "reject_shed": (0, "reason"),
    "_reject_unavailable": (0, "reason"),
}
#: Names that hold a code or a reason where they are assigned or defaulted.
HOLDERS = {"code", "closed_code", "reason"}


def _strings(node: ast.AST | None, constants: dict[str, ast.AST]) -> Iterator[str]:
    """The code-like string constants an expression can evaluate to."""
    if node is None:
        return
    if isinstance(node, ast.Name) and node.id in constants:
        node = constants[node.id]
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        if CODE.match(node.value):
            yield node.value
    elif isinstance(node, ast.IfExp):
        yield from _strings(node.body, constants)
        yield from _strings(node.orelse, constants)


def _tuples(node: ast.AST, constants: dict[str, ast.AST]) -> Iterator[ast.Tuple]:
    """Tuple literals in `node`, and in the values of the module's dicts it names."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Tuple):
            yield sub
        elif isinstance(sub, ast.Name) and isinstance(constants.get(sub.id), ast.Dict):
            dict_node = constants[sub.id]
            assert isinstance(dict_node, ast.Dict)
            yield from (v for v in dict_node.values if isinstance(v, ast.Tuple))


def _name(func: ast.AST) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else None


def codes_in(tree: ast.Module) -> set[str]:
    constants = {
        target.id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (carrier := CARRIERS.get(_name(node.func) or "")):
            position, keyword = carrier
            if len(node.args) > position:
                found.update(_strings(node.args[position], constants))
            for kw in node.keywords:
                if kw.arg == keyword:
                    found.update(_strings(kw.value, constants))
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id in HOLDERS:
                    found.update(_strings(node.value, constants))
                elif isinstance(target, ast.Tuple):
                    names = [t.id if isinstance(t, ast.Name) else "" for t in target.elts]
                    for i, name in enumerate(names):
                        if name not in HOLDERS:
                            continue
                        for literal in _tuples(node.value, constants):
                            if len(literal.elts) == len(names):
                                found.update(_strings(literal.elts[i], constants))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.target.id in HOLDERS:
                found.update(_strings(node.value, constants))
        elif isinstance(node, ast.FunctionDef):
            args = node.args.args[len(node.args.args) - len(node.args.defaults) :]
            for arg, default in zip(args, node.args.defaults, strict=True):
                if arg.arg in HOLDERS:
                    found.update(_strings(default, constants))
    return found


def written_codes() -> set[str]:
    found: set[str] = set()
    for folder in SOURCES:
        for path in folder.rglob("*.py"):
            found |= codes_in(ast.parse(path.read_text(), str(path)))
    return found


def documented_codes() -> dict[str, set[str]]:
    """Codes in the code/reason columns of every doc's tables, by doc."""
    out: dict[str, set[str]] = {}
    for doc in DOCS:
        rows = [line for line in doc.read_text().splitlines()]
        for i, line in enumerate(rows[:-1]):
            if not (line.startswith("|") and re.match(r"^\|( *:?-+:? *\|)+$", rows[i + 1])):
                continue  # not a table's header row
            header = [cell.strip().strip("`").lower() for cell in line.strip("|").split("|")]
            columns = [
                c for c, name in enumerate(header) if name in ("code", "reason", "x-kvgate-reason")
            ]
            if not columns:
                continue
            for row in rows[i + 2 :]:
                if not row.startswith("|"):
                    break
                cells = row.strip("|").split("|")
                for c in columns:
                    names = re.findall(r"`([^`]+)`", cells[c])
                    out.setdefault(doc.name, set()).update(n for n in names if CODE.match(n))
    return out


def test_the_source_is_read_whole() -> None:
    """The collector finds codes of every kind it reads (a refactoring that hides them
    from it fails here, not silently in the comparison)."""
    written = written_codes()
    for code in ("invalid_json", "wait_exceeded", "kv_panic", "queue_timeout", "no_backend",
                 "admin_disabled", "invalid_request", "upstream_timeout", "shutting_down",
                 "context_length_exceeded", "too_many_connections"):  # fmt: skip
        assert code in written, code


def test_the_docs_tables_name_exactly_the_codes_kvgate_writes() -> None:
    written = written_codes()
    documented = documented_codes()
    assert {"operating.md", "flow-control.md"} <= set(documented)
    everywhere = set().union(*documented.values())
    unknown = {doc: sorted(names - written) for doc, names in documented.items() if names - written}
    assert unknown == {}, "documented but never written"
    assert sorted(written - everywhere) == [], "written but in no table of the docs"
