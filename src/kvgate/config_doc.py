"""`kvgate config-doc`: the configuration reference, generated from the config model."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from kvgate.config import KvgateConfig

START, END = "<!-- config-doc:start -->", "<!-- config-doc:end -->"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--update",
        metavar="FILE",
        help="rewrite the table between the config-doc markers of FILE (e.g. README.md)",
    )


def run(args: argparse.Namespace) -> int:
    if args.update:
        path = Path(args.update)
        path.write_text(with_reference(path.read_text(encoding="utf-8")), encoding="utf-8")
        return 0
    print(reference_table())
    return 0


def with_reference(text: str) -> str:
    """`text` with the reference table placed between its config-doc markers."""
    head, found, rest = text.partition(START)
    _, found_end, tail = rest.partition(END)
    if not (found and found_end):
        raise ValueError(f"the markers {START} and {END} are missing")
    return f"{head}{START}\n{reference_table()}\n{END}{tail}"


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value: Any = field.default_factory()  # type: ignore[call-arg]
    else:
        value = field.default
    if value is PydanticUndefined:
        return "(required)"
    return f"`{value!r}`" if not isinstance(value, str) else f"`{value}`"


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows: list[str] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        # A section is its keys, one row each.
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.extend(_rows(annotation, f"{key}."))
            continue
        args = getattr(annotation, "__args__", ())
        if args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            rows.append(f"| `{key}` | `[]` | {field.description or ''} |")
            rows.extend(_rows(args[0], f"{key}[]."))
            continue
        rows.append(f"| `{key}` | {_default(field)} | {field.description or ''} |")
    return rows


def reference_table() -> str:
    """Markdown table of every key: `section.key`, default, meaning."""
    env = "Environment: `KVGATE_<SECTION>__<KEY>`, e.g. `KVGATE_SERVER__LOG_FORMAT=json`."
    head = ["| key | default | meaning |", "| --- | --- | --- |"]
    return "\n".join([*head, *_rows(KvgateConfig, "")]) + "\n\n" + env
