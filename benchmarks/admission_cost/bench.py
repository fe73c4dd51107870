"""Cost of one admission decision in the pure core: µs per admit+release and per reject.

64 fresh nodes (so `adaptive` routes by power of two choices), a ManualClock that moves
50 ms between rounds with a fresh sample for every node (as the scraper would), and
requests of 500 prompt + 500 output tokens. Rejections are measured with every node at
0.95 KV usage (panic: every priority is refused). Figures are CPU time of this process
(`time.process_time`), so that other jobs on a shared machine do not inflate them; each
round times a batch of decisions. Writes results.md next to this file.

    python benchmarks/admission_cost/bench.py [--quick]
    python benchmarks/admission_cost/bench.py --prefix [--quick] [--baseline OTHER/src]

`--prefix` measures the prefix bookkeeping instead (results_prefix.md): 2,048-token prompts
with their token ids (a 1,024-token system prompt shared by all, 1,024 tokens each its
own), admitted and released on 64 nodes by `adaptive` with each routing, against the same
prompts without ids (no hashing, no held blocks, no index). The nodes' engines cache
prefixes in blocks of 16. The requests of a round are placed before any is released, so
the index and the held blocks have content to search. Each case runs in child processes;
`--baseline` runs every case against the kvgate package under another tree's `src/` too
(`git worktree add --detach /tmp/before <commit>`), alternating with this one, so that
the before and after of a change are measured side by side on the same machine load.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvgate.core.admission import Admit, Outcome, Reject
from kvgate.core.clock import ManualClock
from kvgate.core.policies.base import BasePolicy
from kvgate.core.policies.baselines import BaselineOptions, PolicyName, build_named
from kvgate.core.prefix.blocks import block_hashes
from kvgate.core.request import AdmissionRequest, Priority, RequestCost
from kvgate.core.settings import AdmissionSettings
from kvgate.core.signals import NodeSample

NODES = tuple(f"node-{i:02d}" for i in range(64))
COST = RequestCost(prompt_tokens=500, max_output_tokens=500)
POLICIES: list[PolicyName] = ["none", "static-qps", "static-concurrency", "seed", "adaptive"]


def _policy(name: PolicyName, **limits: float) -> tuple[BasePolicy, ManualClock]:
    clock = ManualClock(1000.0)
    knobs = {"qps": 1e9, "burst": 10**9, "concurrency": 10**9} | limits
    options = BaselineOptions(**knobs)  # type: ignore[arg-type]
    policy = build_named(name, AdmissionSettings(), clock, rng_seed=1, options=options)
    assert isinstance(policy, BasePolicy)
    return policy, clock


def _request(request_id: str) -> AdmissionRequest:
    return AdmissionRequest(request_id, COST, Priority.STANDARD, model="m", candidates=NODES)


def _feed(
    policy: BasePolicy, clock: ManualClock, usage: float, block_size: int | None = None
) -> None:
    """A fresh sample of every node; `block_size`: its engine caches prefixes in blocks of
    that many tokens (without one, nothing is shared: prompts count whole)."""
    for node in NODES:
        sample = NodeSample(usage, 1_000_000, 16, 0, 0.02, clock.now(), block_size=block_size)
        policy.observe(node, sample)


def bench_admit_release(name: PolicyName, rounds: int, per_round: int) -> list[float]:
    """µs per admit+release pair, one figure per round."""
    policy, clock = _policy(name)
    figures = []
    for _ in range(rounds):
        clock.advance(0.05)
        _feed(policy, clock, 0.30)
        start = time.process_time()
        for i in range(per_round):
            decision = policy.admit(_request(f"r{i}"))
            assert isinstance(decision, Admit)
            policy.release(decision.ticket, Outcome.DONE)
        figures.append((time.process_time() - start) / per_round * 1e6)
    return figures


def bench_reject(name: PolicyName, rounds: int, per_round: int) -> list[float] | None:
    """µs per rejection with every node in panic; None when the policy never rejects here."""
    policy, clock = _policy(name, qps=1e-6, burst=1, concurrency=1)
    policy.admit(_request("hold"))  # spends the bucket / the slot
    figures = []
    for _ in range(rounds):
        clock.advance(0.05)
        _feed(policy, clock, 0.95)
        probe = policy.admit(_request("probe"))
        if not isinstance(probe, Reject):
            return None
        start = time.process_time()
        for i in range(per_round):
            policy.admit(_request(f"r{i}"))
        figures.append((time.process_time() - start) / per_round * 1e6)
    return figures


def bench_reject_after_sample(name: PolicyName, rounds: int, per_round: int) -> list[float]:
    """µs per (one node's new sample + one rejection): the refusal cache is always cold."""
    policy, clock = _policy(name, qps=1e-6, burst=1, concurrency=1)
    policy.admit(_request("hold"))
    figures = []
    for _ in range(rounds):
        clock.advance(0.05)
        _feed(policy, clock, 0.95)
        start = time.process_time()
        for i in range(per_round):
            node = NODES[i % len(NODES)]
            policy.observe(node, NodeSample(0.95, 1_000_000, 16, 0, 0.02, clock.now()))
            policy.admit(_request(f"r{i}"))
        figures.append((time.process_time() - start) / per_round * 1e6)
    return figures


def bench_observe(name: PolicyName, rounds: int, per_round: int) -> list[float]:
    """µs per sample fed to the policy (what the scraper costs the core)."""
    policy, clock = _policy(name)
    for i in range(200):  # some live tickets, so that reflection has work to do
        decision = policy.admit(_request(f"t{i}"))
        if isinstance(decision, Admit):
            policy.on_first_token(decision.ticket)
    figures = []
    for _ in range(rounds):
        clock.advance(0.05)
        start = time.process_time()
        for i in range(per_round):
            node = NODES[i % len(NODES)]
            policy.observe(node, NodeSample(0.5, 1_000_000, 16, 0, 0.02, clock.now()))
        figures.append((time.process_time() - start) / per_round * 1e6)
    return figures


SYSTEM = tuple(range(100_000, 101_024))
#: The engines' KV block size in `--prefix` (vLLM's default).
BLOCK_SIZE = 16


def _prefix_requests(n: int, ids: bool, first: int = 0) -> list[AdmissionRequest]:
    """`n` requests with the system prompt and 1,024 tokens of their own: those of
    requests `first` to `first + n - 1` (the same `first` gives the same prompts)."""
    cost = RequestCost(prompt_tokens=2048, max_output_tokens=200)
    out = []
    for i in range(first, first + n):
        prompt = SYSTEM + tuple(range(i * 2048, i * 2048 + 1024)) if ids else None
        out.append(AdmissionRequest(f"p{i}", cost, Priority.STANDARD, model="m",
                                    candidates=NODES, prompt_ids=prompt))  # fmt: skip
    return out


def bench_prefix(
    name: PolicyName, ids: bool, rounds: int, per_round: int, fresh: bool = False
) -> list[float]:
    """µs per admit+release of a 2k-token prompt (a round places all, then releases all).
    Every round sends the same prompts again (each is cached whole where it went), or
    with `fresh` new ones (only the system prompt is cached anywhere)."""
    policy, clock = _policy(name)
    figures = []
    for r in range(rounds):
        clock.advance(0.05)
        _feed(policy, clock, 0.30, BLOCK_SIZE)
        # The prompts are built, met once by the garbage collector and freed outside the
        # timing: each is a fresh tuple of 2,048 ints, whatever the policy does with it.
        requests = _prefix_requests(per_round, ids, r * per_round if fresh else 0)
        gc.collect()
        start = time.process_time()
        tickets = []
        for request in requests:
            decision = policy.admit(request)
            assert isinstance(decision, Admit)
            tickets.append(decision.ticket)
        for ticket in tickets:
            policy.release(ticket, Outcome.DONE)
        figures.append((time.process_time() - start) / per_round * 1e6)
        del tickets, requests
    return figures


PREFIX_CASES: list[tuple[PolicyName, bool, bool, str]] = [
    ("headroom-only", False, False, "no token ids (today's cost)"),
    ("headroom-only", True, False, "held blocks counted once"),
    ("prefix-aware", True, False, "held blocks + prefix routing (approximate index)"),
    ("headroom-only", True, True, "held blocks, a new prompt every request"),
    ("prefix-aware", True, True, "held blocks + prefix routing, a new prompt every request"),
]
#: Child processes per case and tree; with a baseline they alternate between the trees.
CHUNKS = 6


def bench_hashing(rounds: int, per_round: int) -> list[float]:
    """µs per `block_hashes` of one 2k-token prompt."""
    figures = []
    for _ in range(rounds):
        prompts = [r.prompt_ids or () for r in _prefix_requests(per_round, True)]
        gc.collect()
        start = time.process_time()
        for ids in prompts:
            block_hashes(ids, BLOCK_SIZE)
        figures.append((time.process_time() - start) / per_round * 1e6)
    return figures


def _child(src: str | None, case: str, rounds: int, per_round: int) -> list[float]:
    """One case's figures from a child process importing kvgate from `src` (None: the
    interpreter's own), after one round to warm up."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = src
    args = [sys.executable, __file__, "--prefix-case", case, str(rounds + 1), str(per_round)]
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout
    figures: list[float] = json.loads(out)[1:]
    return figures


def main_prefix(quick: bool, baseline: str | None) -> int:
    rounds, per_round = (6, 200) if quick else (30, 500)
    trees: list[str | None] = [None] if baseline is None else [baseline, None]
    cases = [
        (f"{name}:{int(ids)}:{int(fresh)}", f"`{name}`", what)
        for name, ids, fresh, what in PREFIX_CASES
    ]
    cases.append(("hash", "-", "`block_hashes` alone (128 blocks of 16)"))
    rows = []
    for case, name, what in cases:
        figures: dict[str | None, list[float]] = {tree: [] for tree in trees}
        for chunk in range(CHUNKS):
            for tree in trees if chunk % 2 == 0 else trees[::-1]:
                figures[tree] += _child(tree, case, max(1, rounds // CHUNKS), per_round)
        cells = " | ".join(_cell(figures[tree]) for tree in trees)
        rows.append(f"| {name} | {what} | {cells} |")
        print(rows[-1], flush=True)
    heads = "CPU µs per request |" if baseline is None else "before | after |"
    command = "python benchmarks/admission_cost/bench.py --prefix" + (" --quick" if quick else "")
    before = ""
    if baseline is not None:
        command += " --baseline BEFORE/src"
        commit = _commit(baseline)
        before = (
            f"BEFORE: commit {commit} (`git worktree add --detach BEFORE {commit}`); after:"
            " this tree.\n"
        )
    out = Path(__file__).with_name("results_prefix.md")
    out.write_text(
        "# Prefix bookkeeping cost (pure core, 64 nodes, 2,048-token prompts)\n\n"
        f"Command: `{command}` ({rounds} rounds x {per_round} requests per tree, in"
        f" {CHUNKS} child processes each"
        + (", alternating between the trees" if baseline is not None else "")
        + "; median (min-max) CPU µs per admit + release).\n"
        + before
        + f"Machine: {platform.machine()}, Python {platform.python_version()},"
        f" {platform.system()} (shared 2-core box; other jobs were running).\n\n"
        f"| policy | what it does | {heads}\n| --- | --- |{' --- |' * len(trees)}\n"
        + "\n".join(rows)
        + "\n\nThe difference between the first row and the others is what the prefix"
        " bookkeeping costs per request: hashing the prompt's 128 blocks once, the held"
        " blocks' ledger, and for prefix routing the index's look-up and update. The first"
        " three send the same 500 prompts every round (each is found cached whole on the"
        " engine it went to before); the last two a new 1,024-token part every time (only"
        " the system prompt is cached, on every engine).\n"
    )
    print(f"wrote {out}")
    return 0


def _commit(src: str) -> str:
    """The commit checked out where `src` is (its path when git cannot say)."""
    try:
        args = ["git", "-C", src, "rev-parse", "--short", "HEAD"]
        return subprocess.run(args, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return src


def _run_case(case: str, rounds: int, per_round: int) -> int:
    """A child's part of `main_prefix`: one case's figures, as JSON on stdout."""
    if case == "hash":
        figures = bench_hashing(rounds, per_round)
    else:
        name, ids, fresh = case.split(":")
        figures = bench_prefix(name, ids == "1", rounds, per_round, fresh == "1")  # type: ignore[arg-type]
    print(json.dumps(figures))
    return 0


def _cell(figures: list[float] | None) -> str:
    if figures is None:
        return "n/a"
    return f"{statistics.median(figures):.2f} ({min(figures):.2f}-{max(figures):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer rounds (smoke run)")
    parser.add_argument("--prefix", action="store_true", help="the prefix bookkeeping's cost")
    parser.add_argument(
        "--baseline",
        metavar="SRC",
        help="with --prefix: also measure the kvgate package under SRC (another tree's src/)"
        " side by side, alternating",
    )
    parser.add_argument("--prefix-case", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prefix_case:
        case, rounds, per_round = args.prefix_case
        return _run_case(case, int(rounds), int(per_round))
    if args.prefix:
        return main_prefix(args.quick, args.baseline)
    rounds, per_round = (5, 500) if args.quick else (30, 2000)
    rows = []
    for name in POLICIES:
        admit = bench_admit_release(name, rounds, per_round)
        reject = bench_reject(name, rounds, per_round)
        cold = bench_reject_after_sample(name, rounds, per_round) if reject else None
        observe = bench_observe(name, rounds, per_round)
        rows.append(
            f"| `{name}` | {_cell(admit)} | {_cell(reject)} | {_cell(cold)} | {_cell(observe)} |"
        )
        print(rows[-1], flush=True)
    out = Path(__file__).with_name("results.md")
    out.write_text(
        "# Admission cost (pure core, 64 nodes)\n\n"
        f"Command: `python benchmarks/admission_cost/bench.py{' --quick' if args.quick else ''}`"
        f" ({rounds} rounds x {per_round} decisions; median (min-max) CPU µs per decision).\n"
        f"Machine: {platform.machine()}, Python {platform.python_version()},"
        f" {platform.system()} (shared 2-core box; other jobs were running).\n\n"
        "| policy | admit + release | reject | sample + reject | sample |\n"
        "| --- | --- | --- | --- | --- |\n"
        + "\n".join(rows)
        + "\n\n`reject`: repeated refusals between two samples; `sample + reject`: one node's"
        " new sample then one refusal (adaptive checks two random nodes, then all 64, before"
        " it refuses); `sample`: one `observe()` with 200 live tickets spread over the"
        " nodes. `n/a`: `none` never refuses. All figures in CPU µs per operation, of the"
        " placement policy alone (the flow controller around it is not included).\n"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
