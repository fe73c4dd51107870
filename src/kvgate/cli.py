"""The `kvgate` command: one entry point, one module per subcommand.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`, and keeps
its heavy imports inside `run` so that `kvgate --help` stays instant, and so that every
subcommand's `--help` works without its optional extra: a package of an extra that is
missing when the subcommand runs is named with the `pip install` that brings it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvgate.gateway.cli", "run the gateway (simulated engines if no backend is given)"),
    "sim": ("kvgate.sim.cli", "run simulated vLLM engines (OpenAI-compatible, vLLM metrics)"),
    "bench": (
        "kvgate.bench.cli",
        "run a benchmark (overload, routings on shared prefixes) and write a report "
        "(needs pip install 'kvgate[bench]')",
    ),
    "status": ("kvgate.status", "show what a running gateway sees (a table; --watch refreshes)"),
    "config-doc": ("kvgate.config_doc", "print every config key with its default and meaning"),
}


def build_parser() -> argparse.ArgumentParser:
    import kvgate

    parser = argparse.ArgumentParser(
        prog="kvgate",
        description=(kvgate.__doc__ or "").strip(),
        epilog="`kvgate COMMAND --help` lists a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
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
            package = exc.name or "?"
            command.set_defaults(_run=lambda _, c=name, p=package: _needs_extra(c, p))
            continue
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


#: The extra that brings a subcommand's optional packages.
EXTRAS = {"bench": "bench"}


def _version() -> str:
    import importlib.metadata  # 40 ms: only for --version

    try:
        return importlib.metadata.version("kvgate")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        from kvgate import __version__

        return __version__


def _needs_extra(command: str, package: str) -> int:
    extra = EXTRAS.get(command, command)
    print(
        f"kvgate {command} needs the Python package {package!r}: pip install 'kvgate[{extra}]'",
        file=sys.stderr,
    )
    return 2


#: The exit status of a command interrupted by Ctrl-C (128 + SIGINT), as shells report it.
INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; its exit status.

    Ctrl-C before a command handles SIGINT itself (while kvgate imports and starts, or in a
    command that never does) ends it quietly with status 130, not with a traceback.
    """
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return INTERRUPTED
    except ModuleNotFoundError as exc:
        command = next((a for a in (argv or sys.argv[1:]) if a in SUBCOMMANDS), None)
        if command is None or (exc.name or "").startswith("kvgate"):
            raise
        return _needs_extra(command, exc.name or "?")


if __name__ == "__main__":
    sys.exit(main())
