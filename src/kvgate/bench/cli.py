"""`kvgate bench`: run the overload benchmark and write its report.

    kvgate bench virtual  [--preset gpu-8b --nodes 16 --duration 300 --seeds 1,2,3 ...]
    kvgate bench live-sim [--nodes 2 --duration 60 ...]   # HTTP: kvgate serve -> kvgate sim
    kvgate bench live-vllm [--duration 90 ...]            # HTTP: the real vLLM CPU engine
    kvgate bench prefix   [--workload chats --conversations 1200 ...]  # shared prefixes

Needs the `bench` extra (`pip install 'kvgate[bench]'`: numpy, matplotlib); its help does
not. The overload modes measure the sustainable capacity first (or take
`--capacity-scale`), then run each load x policy x seed on the same seeded workload and
write `report.md`, PNG plots and `results.json` into `--out`. `prefix` runs a
shared-prefix workload (multi-turn chats, RAG, a system prompt per tenant, a hot prefix) in
virtual time on engines with prefix caching under each routing x seed, and writes
`report.md`, `routing.png` and `results.json` (`kvgate.bench.prefix`).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

DEFAULT_LOADS = "0.5,1,2,3"


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2.5: {text!r}") from None


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,2: {text!r}") from None


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _policies(mode: str, names: list[str] | None) -> list[str] | None:
    """The policies (`prefix`: routings) named, checked; None: the mode's default."""
    if names is None:
        return None
    if mode == "prefix":
        from kvgate.bench.prefix import ROUTINGS

        known, everything = list(ROUTINGS), list(ROUTINGS)
    else:
        from kvgate.bench.profiles import DEFAULT_POLICIES, POLICIES  # the bench extra (numpy)

        known, everything = list(POLICIES), list(DEFAULT_POLICIES)
    if names == ["all"]:
        return everything
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown policy {unknown[0]!r}; choose from {', '.join(known)} or 'all'")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "mode",
        choices=["virtual", "live-sim", "live-vllm", "prefix"],
        help="virtual time (simulator + admission core), live HTTP runs, or routings "
        "compared on shared-prefix traffic (virtual time)",
    )
    parser.add_argument("--preset", default=None, help="engine preset (default per mode)")
    parser.add_argument("--nodes", type=int, default=None, help="engines (default per mode)")
    parser.add_argument("--duration", type=float, default=None, help="seconds of traffic")
    parser.add_argument("--warmup", type=float, default=None, help="seconds not scored")
    parser.add_argument(
        "--loads",
        type=_floats,
        default=_floats(DEFAULT_LOADS),
        help=f"offered loads, multiples of the sustainable capacity ({DEFAULT_LOADS})",
    )
    parser.add_argument(
        "--policies", type=_names, default=None,
        help="comma list or 'all' (prefix: routings, e.g. round-robin,least-loaded)",
    )  # fmt: skip
    parser.add_argument("--seeds", type=_ints, default=None, help="comma list of seeds")
    parser.add_argument(
        "--retry", choices=["immediate", "backoff"], default="immediate",
        help="client retry on timeout/5xx",
    )  # fmt: skip
    parser.add_argument("--max-attempts", type=int, default=4, help="tries before giving up")
    parser.add_argument("--timeout", type=float, default=None, help="client timeout (s)")
    parser.add_argument(
        "--clients-say-timeout", action="store_true",
        help="each try carries its client's timeout: a whole-answer one as a proxy's route"
        " timeout (Envoy's x-envoy-expected-rq-timeout-ms), a read timeout as the OpenAI SDKs'",
    )  # fmt: skip
    parser.add_argument(
        "--capacity-scale", type=float, default=None,
        help="skip the capacity search and use this scale of the profile's mix as 1x",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="report directory")
    parser.add_argument(
        "--scrape-interval",
        type=float,
        default=None,
        help="live runs: the gateway's scrape period (default 0.05 s; live-vllm 0.2 s)",
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="parallel processes for virtual runs (default 1)"
    )
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    prefix = parser.add_argument_group(
        "prefix mode",
        "also --preset (gpu-8b, with prefix caching), --nodes (8), --duration (rag, tenants, "
        "hot-prefix: 60 s of arrivals), --policies (routings: all), --seeds (1), --out, --quick",
    )
    prefix.add_argument(
        "--workload", default="chats", help="chats, rag, tenants or hot-prefix (chats)"
    )
    prefix.add_argument(
        "--conversations", type=int, default=None,
        help="chats: conversations of 5 turns (150 per engine)",
    )  # fmt: skip
    prefix.add_argument(
        "--rate", type=float, default=None,
        help="rag, tenants, hot-prefix: requests/s (18.75 per engine)",
    )  # fmt: skip


OVERLOAD_OPTIONS = (
    "preset", "nodes", "duration", "warmup", "loads", "policies", "seeds", "retry",
    "max_attempts", "timeout", "capacity_scale", "scrape_interval", "jobs", "out",
)  # fmt: skip
PREFIX_OPTIONS = ("preset", "nodes", "duration", "policies", "seeds", "conversations", "rate",
                  "out")  # fmt: skip


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run, rebuilt from the parsed options."""
    parts = ["kvgate", "bench", args.mode]
    if args.mode == "prefix":
        parts += ["--workload", args.workload]
        names: tuple[str, ...] = PREFIX_OPTIONS
    else:
        names = OVERLOAD_OPTIONS
    for name in names:
        value = getattr(args, name)
        if value is None:
            continue
        if isinstance(value, list):
            value = ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)
        parts += ["--" + name.replace("_", "-"), str(value)]
    if args.quick:
        parts.append("--quick")
    if getattr(args, "clients_say_timeout", False):
        parts.append("--clients-say-timeout")
    return " ".join(shlex.quote(p) for p in parts)


def _check(args: argparse.Namespace) -> None:
    """Refuse nonsense before anything starts (a clear message, not a traceback)."""
    if args.nodes is not None and args.nodes < 1:
        raise ValueError("--nodes must be at least 1")
    for name in ("duration", "timeout", "capacity_scale", "scrape_interval", "rate"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    if not args.loads or any(x <= 0 for x in args.loads):
        raise ValueError("--loads must be positive numbers")
    if args.max_attempts < 1 or args.jobs < 1:
        raise ValueError("--max-attempts and --jobs must be at least 1")
    if args.conversations is not None and args.conversations < 1:
        raise ValueError("--conversations must be at least 1")
    args.policies = _policies(args.mode, args.policies)
    if args.mode == "prefix":
        from kvgate.bench.prefix import WORKLOADS

        if args.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {args.workload!r}; choose from "
                             f"{', '.join(WORKLOADS)}")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    command = _command(args)
    try:
        _check(args)
        if args.mode == "prefix":
            from kvgate.bench.prefix import main_prefix

            report = main_prefix(args, command)
        else:
            from kvgate.bench.driver import BenchOptions, main_live, main_virtual

            opts = BenchOptions.from_args(args, command)
            report = main_virtual(opts) if args.mode == "virtual" else main_live(opts)
    except (ValueError, KeyError, RuntimeError) as exc:
        print(f"kvgate bench: {exc}", file=sys.stderr)
        return 2
    print(f"report written to {report}")
    return 0
