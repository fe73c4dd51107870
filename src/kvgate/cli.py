"""The `kvgate` command: one entry point, one module per subcommand.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`, and keeps
its heavy imports inside `run` so that `kvgate --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvgate.gateway.cli", "run the gateway (simulated engines if no backend is given)"),
    "sim": ("kvgate.sim.cli", "run simulated vLLM engines (OpenAI-compatible, vLLM metrics)"),
    "bench": ("kvgate.bench.cli", "run the overload benchmark and write a report"),
    "status": ("kvgate.status", "show what a running gateway sees (a table; --watch refreshes)"),
    "config-doc": ("kvgate.config_doc", "print every config key with its default and meaning"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if (exc.name or "").startswith("kvgate"):
                raise
            # An optional extra is missing (e.g. matplotlib for `kvgate bench`): say which.
            command.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
            command.set_defaults(_run=_missing_extra(name, exc.name or "?"))
            continue
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


EXTRAS = {"bench": "bench"}


def _missing_extra(command: str, package: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        extra = EXTRAS.get(command, command)
        print(
            f"kvgate {command} needs the Python package {package!r}: pip install 'kvgate[{extra}]'",
            file=sys.stderr,
        )
        return 2

    return run


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
