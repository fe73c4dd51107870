"""`python -m kvgate.bench.serve --baseline NAME [kvgate serve options]`: a gateway that
admits with one of the baselines the benchmark compares kvgate with.

A live benchmark run (`kvgate bench live-sim`, `live-vllm`) and the benchmark scripts under
`benchmarks/` start it in place of `kvgate serve`, which admits with kvgate's adaptive
policy only. It takes every option of `kvgate serve` (but `--workers`: a baseline runs in
one process) and the baselines' quotas, which are not configuration: `--qps` and `--burst`
of `static-qps`'s token bucket, `--concurrency` of `static-concurrency`'s cap.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvgate.core.clock import Clock
from kvgate.core.policies.base import BasePolicy
from kvgate.core.policies.baselines import POLICY_NAMES, BaselineOptions, build_named, policy_name
from kvgate.core.settings import AdmissionSettings
from kvgate.gateway import cli as serve

BASELINES = tuple(name for name in POLICY_NAMES if name != "adaptive")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kvgate.bench.serve", description=(__doc__ or "").split("\n\n")[0]
    )
    defaults = BaselineOptions()
    parser.add_argument("--baseline", choices=BASELINES, required=True, help="the baseline")
    parser.add_argument(
        "--qps", type=float, default=defaults.qps, help="static-qps: requests per second"
    )
    parser.add_argument(
        "--burst", type=int, default=defaults.burst, help="static-qps: the bucket's depth"
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=defaults.concurrency,
        help="static-concurrency: requests in flight at most",
    )
    serve.add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        options = BaselineOptions(args.qps, args.burst, args.concurrency)
    except ValueError as exc:
        print(f"kvgate.bench.serve: {exc}", file=sys.stderr)
        return 2
    name = policy_name(args.baseline)

    def baseline(settings: AdmissionSettings, clock: Clock) -> BasePolicy:
        policy = build_named(name, settings, clock, options=options)
        assert isinstance(policy, BasePolicy)
        return policy

    return serve.run(args, baseline)


if __name__ == "__main__":
    sys.exit(main())
