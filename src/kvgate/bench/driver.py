"""Glue for `kvgate bench`: options per mode, capacity, the grid, the report.

Virtual mode measures capacity with a geometric bisection of `direct` runs (see
`kvgate.bench.suite`). Live modes cannot afford a bisection from scratch in real time:
they start from the same bisection run in virtual time on the `cpu-tiny` preset, which is
calibrated to the real vLLM CPU engine. `live-sim` takes that scale as 1x (its engines are
the simulator). `live-vllm` measures the live capacity of the machine it runs on: from the
virtual scale it doubles up (or halves down) with live `direct` runs until the criterion
breaks, then bisects the bracket twice (`find_capacity_near`), and that scale is 1x; the
goodput `direct` achieved there is the capacity.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console

from kvgate.bench.metrics import RunResult, summarize
from kvgate.bench.profiles import DEFAULT_POLICIES, POLICIES, Profile, get_profile
from kvgate.bench.report import ReportMeta, write_report
from kvgate.bench.suite import (
    Runner,
    RunSpec,
    describe_capacity,
    find_capacity,
    find_capacity_near,
    run_grid,
    tuned_overrides,
)
from kvgate.sim.runs import RetryMode

REPO = Path(__file__).resolve().parents[3]
RESULTS = REPO / "benchmarks" / "overload" / "results"
# One real engine per machine: measurements that start it take this lock first. The default
# sits beside the engine's install (scripts/install-real-vllm.sh), so every checkout on the
# machine shares it.
_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
REAL_VLLM_LOCK = Path(
    os.environ.get("KVGATE_REAL_VLLM_LOCK")
    or Path(os.environ.get("KVGATE_VLLM_ROOT") or _CACHE / "kvgate-vllm") / "engine.lock"
)
REAL_VLLM_SERVE = Path(
    os.environ.get("KVGATE_REAL_VLLM_SERVE", str(REPO / "scripts/real-vllm/serve.sh"))
)

console = Console(stderr=True)


@dataclass
class BenchOptions:
    mode: str
    command: str
    preset: str
    nodes: int
    duration_s: float
    warmup_s: float
    loads: list[float]
    policies: list[str]
    seeds: list[int]
    retry: RetryMode
    max_attempts: int
    timeout_s: float | None
    capacity_scale: float | None
    out: Path
    quick: bool
    jobs: int = 1
    scrape_s: float = 0.05
    says_timeout: bool = False

    @classmethod
    def from_args(cls, a: argparse.Namespace, command: str) -> BenchOptions:
        quick = bool(a.quick)
        # Each mode's defaults: preset, nodes, duration, warm-up, seeds and policies.
        if a.mode == "virtual":
            preset, nodes, dur = "gpu-8b", 4 if quick else 16, 60.0 if quick else 300.0
            warm, seeds = (10.0, [1]) if quick else (30.0, [1, 2, 3])
            pol = list(DEFAULT_POLICIES)
        elif a.mode == "live-sim":
            preset, nodes, dur, warm, seeds = "cpu-tiny", 2, 20.0 if quick else 60.0, 5.0, [1]
            pol = ["direct", "static-qps", "static-concurrency", "seed", "adaptive"]
        else:
            preset, nodes, dur, warm, seeds = "cpu-tiny", 1, 20.0 if quick else 60.0, 5.0, [1]
            pol = ["direct", "adaptive"]
        if a.mode == "live-vllm" and (a.nodes or 1) != 1:
            raise ValueError("live-vllm runs one real engine (this machine holds one)")
        out = a.out or RESULTS / (a.mode + ("-quick" if quick else ""))
        return cls(
            mode=a.mode,
            command=command,
            preset=a.preset or preset,
            nodes=a.nodes or nodes,
            duration_s=a.duration or dur,
            warmup_s=a.warmup if a.warmup is not None else warm,
            loads=a.loads,
            policies=a.policies or pol,
            seeds=a.seeds or seeds,
            retry=a.retry,
            max_attempts=a.max_attempts,
            timeout_s=a.timeout,
            capacity_scale=a.capacity_scale,
            out=out,
            quick=quick,
            jobs=max(1, int(getattr(a, "jobs", 1) or 1)),
            scrape_s=a.scrape_interval or (0.2 if a.mode == "live-vllm" else 0.05),
            says_timeout=bool(getattr(a, "clients_say_timeout", False)),
        )


def _profile(opts: BenchOptions) -> Profile:
    prof = get_profile(opts.preset)
    client = replace(
        prof.client,
        retry=opts.retry,
        max_attempts=opts.max_attempts,
        says_timeout=opts.says_timeout,
    )
    if opts.timeout_s is not None:
        client = replace(client, timeout_s=opts.timeout_s)
    return replace(prof, client=client)


def _base_spec(opts: BenchOptions, prof: Profile, duration_s: float, nodes: int) -> RunSpec:
    return RunSpec(
        preset=prof.preset,
        nodes=nodes,
        shape=prof.shape,
        load=1.0,
        seed=opts.seeds[0],
        duration_s=duration_s,
        warmup_s=min(opts.warmup_s, duration_s / 4),
        client=prof.client,
        slo=prof.slo,
        label="direct",
        policy="none",
    )


def _capacity(
    opts: BenchOptions, prof: Profile, nodes: int, duration_s: float
) -> tuple[float, RunResult | None, RunSpec, str]:
    """The 1x scale (virtual-time bisection with `direct`), unless given on the command line."""
    from kvgate.bench.virtual import run_virtual

    base = _base_spec(opts, prof, duration_s, nodes)
    how = (
        "highest scale of the profile's mix at which `direct` (no gateway) served >= 95% of "
        "user requests within the SLO with zero preemptions, found by a 7-step geometric "
        f"bisection in virtual time ({nodes} x {prof.preset}, {duration_s:g} s, seed "
        f"{base.seed})"
    )
    if opts.capacity_scale is not None:
        scale = opts.capacity_scale
        run = run_virtual(replace(base, shape=prof.shape.scaled(scale)))
        return scale, run, base, "given with --capacity-scale; " + how

    def step(scale: float, ok: bool) -> None:
        console.print(f"  capacity search: scale {scale:.3f} {'sustained' if ok else 'failed'}")

    console.print("[bold]measuring sustainable capacity with `direct`...")
    scale, found = find_capacity(base, run_virtual, on_step=step)
    return scale, found, base, how


def _specs(
    opts: BenchOptions, prof: Profile, scale: float, cap_run: RunResult | None
) -> list[RunSpec]:
    shape = prof.shape.scaled(scale)
    specs: list[RunSpec] = []
    for load in opts.loads:
        for label in opts.policies:
            variant = POLICIES[label]
            for seed in opts.seeds:
                specs.append(
                    RunSpec(
                        preset=prof.preset,
                        nodes=opts.nodes,
                        shape=shape,
                        load=load,
                        seed=seed,
                        duration_s=opts.duration_s,
                        warmup_s=opts.warmup_s,
                        client=prof.client,
                        slo=prof.slo,
                        label=label,
                        policy=variant.policy,
                        cancel=variant.cancel,
                        queue=variant.queue,
                        order=variant.order,
                        feedback=variant.feedback,
                        policy_overrides=tuned_overrides(label, shape, opts.nodes, cap_run),
                    )
                )
    return specs


#: How a client that says its timeout sends it, by what it times.
_SAID = {
    "answer": "as a proxy's route timeout (`x-envoy-expected-rq-timeout-ms`)",
    "token": "as the OpenAI SDKs send their read timeout",
}


def _scenario(opts: BenchOptions, prof: Profile, scale: float) -> dict[str, str]:
    s = prof.shape.scaled(scale)
    c = prof.client
    return {
        "engines": f"{opts.nodes} x `{prof.preset}` ({prof.why})",
        "traffic": f"{opts.duration_s:g} s per run, first {opts.warmup_s:g} s not scored",
        "chat turns": f"prompt {s.chat_prompt[0]}-{s.chat_prompt[1]} tokens, "
        f"output {s.chat_output[0]}-{s.chat_output[1]} tokens (max_tokens, ignore_eos)",
        "long summaries": f"prompt {s.long_prompt_frac[0]:.0%}-{s.long_prompt_frac[1]:.0%} "
        f"of one node's {s.kv_capacity_tokens:,} KV tokens, output "
        f"{s.long_output[0]}-{s.long_output[1]} tokens",
        "bursts": f"from {s.first_burst_s:g} s, every {s.burst_every_s:g} s, "
        f"{s.burst_per_node:g} x nodes x load long requests within 200 ms",
        "loads": ", ".join(f"{x:g}x" for x in opts.loads),
        "clients": f"timeout {c.timeout_s:g} s (then disconnect)"
        + (f", sent with each try {_SAID[c.deadline]}" if c.says_timeout else "")
        + f", retry on timeout/5xx {c.retry}, 429 waits Retry-After, give up after"
        f" {c.max_attempts} tries",
        "static-qps": "token bucket at the 1x mean arrival rate, depth one 1x burst",
        "static-concurrency": "cap = peak requests running at 1x under `direct`",
    }


def main_virtual(opts: BenchOptions) -> Path:
    from kvgate.bench.virtual import run_virtual

    prof = _profile(opts)
    cap_duration = min(opts.duration_s, 120.0)
    scale, cap_run, base, how = _capacity(opts, prof, opts.nodes, cap_duration)
    cap = describe_capacity(scale, base, cap_run, how)
    cap_goodput = cap.get("goodput_tok_s", 0.0)
    runs: list[RunResult] = []
    report = opts.out / "report.md"
    # The focus load first, then 1x (the capacity reference), then the rest: a report is
    # rewritten after each load, so an interrupted run still leaves the most useful part.
    for load in sorted(opts.loads, key=lambda x: (x != 3.0, x != 1.0, x)):
        specs = _specs(replace(opts, loads=[load]), prof, scale, cap_run)
        runs += run_grid(
            specs, run_virtual, f"virtual {opts.preset} x{opts.nodes} @ {load:g}x", opts.jobs
        )
        runs.sort(key=lambda r: (r.load, r.seed))
        cap["goodput_tok_s"] = _direct_1x_goodput(runs, cap_goodput)
        meta = ReportMeta(
            title=f"kvgate overload benchmark, virtual time, {opts.nodes} x {opts.preset}",
            command=opts.command,
            seeds=opts.seeds,
            scenario=_scenario(opts, prof, scale),
            slo=_slo_dict(prof),
            capacity=cap,
            notes=_notes(runs),
        )
        report = write_report(runs, meta, opts.out, keep=True)
        console.print(f"  report updated: {report}")
    return report


def _direct_1x_goodput(runs: list[RunResult], fallback: float) -> float:
    vals = [summarize(r)["goodput_tok_s"] for r in runs if r.policy == "direct" and r.load == 1.0]
    return round(sum(vals) / len(vals), 1) if vals else fallback


def _slo_dict(prof: Profile) -> dict[str, str]:
    s = prof.slo
    return {
        "TTFT, chat (from the user's first try)": f"<= {s.ttft_s:g} s",
        "TTFT, long prompt (from the user's first try)": f"<= {s.long_ttft_s:g} s",
        "TPOT (mean after the first token)": f"<= {s.tpot_s * 1000:g} ms",
        "and": "the whole answer within the client's timeout",
    }


def _notes(runs: list[RunResult]) -> list[str]:
    notes = []
    for r in runs:
        for text in r.extra.get("notes", []):
            if text not in notes:
                notes.append(text)
    return notes


# --- live -----------------------------------------------------------------------------------


def main_live(opts: BenchOptions) -> Path:
    from kvgate.bench.live.driver import live_runner

    prof = _profile(opts)
    cap_nodes = opts.nodes
    scale, cap_run, base, how = _capacity(opts, prof, cap_nodes, 120.0)
    live_search = opts.mode == "live-vllm" and opts.capacity_scale is None
    with live_runner(opts) as runner:
        if live_search:
            guess = scale
            scale, cap_run = _live_capacity(opts, prof, runner, guess)
            how = (
                f"measured live: from the virtual-time scale {guess:.3f} ({how}), live "
                f"`direct` runs of {opts.duration_s:g} s doubling up or halving down until "
                "it failed >= 95% of users in SLO with no preemption, then two geometric "
                "bisections; the capacity is the goodput `direct` achieved there"
            )
        else:
            how = given_scale_how(opts, how)
        cap = describe_capacity(scale, base, cap_run, how)
        specs = _specs(opts, prof, scale, cap_run)
        runs = run_grid(specs, runner, f"{opts.mode} x{opts.nodes}")
    cap["goodput_tok_s"] = _direct_1x_goodput(runs, cap.get("goodput_tok_s", math.nan))
    where = "`kvgate serve` -> `kvgate sim`" if opts.mode == "live-sim" else "real vLLM CPU"
    scenario = _scenario(opts, prof, scale)
    scenario["gateway"] = (
        f"fresh `kvgate serve` per run, scraping every {opts.scrape_s:g} s (timeout 80% of "
        "that); `direct` runs send straight to the engines, round-robin"
    )
    meta = ReportMeta(
        title=f"kvgate overload benchmark, live HTTP, {where}, {opts.nodes} engine(s)",
        command=opts.command,
        seeds=opts.seeds,
        scenario=scenario,
        slo=_slo_dict(prof),
        capacity=cap,
        notes=_notes(runs),
    )
    return write_report(runs, meta, opts.out, keep=True)


def given_scale_how(opts: BenchOptions, how: str) -> str:
    """How a live run's 1x was found when it was not measured live (`live-sim`, or
    `--capacity-scale`): the capacity figures are live only if `direct` ran at 1x."""
    head = (
        "1x taken from the virtual-time capacity search on the calibrated `cpu-tiny` preset"
        f" ({how})"
    )
    if 1.0 in opts.loads and "direct" in opts.policies:
        return head + "; the live capacity is the goodput `direct` achieved live at 1x"
    return (
        head + "; no live `direct` run at 1x, so the goodput and `direct at 1x` lines below, "
        "and the % of capacity, are the virtual run's at this scale"
    )


def _live_capacity(
    opts: BenchOptions, prof: Profile, runner: Runner, guess: float
) -> tuple[float, RunResult | None]:
    """The 1x scale measured live with `direct` (`find_capacity_near` from `guess`)."""

    def step(scale: float, ok: bool) -> None:
        console.print(f"  live capacity: scale {scale:.3f} {'sustained' if ok else 'failed'}")

    console.print("[bold]measuring the live sustainable capacity with `direct`...")
    base = _base_spec(opts, prof, opts.duration_s, opts.nodes)
    return find_capacity_near(base, runner, guess, on_step=step)


@contextlib.contextmanager
def real_vllm_lock(timeout_s: float = 1800.0) -> Iterator[None]:
    """Hold the machine-wide lock for the real engine, so two measurements never overlap."""
    REAL_VLLM_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(REAL_VLLM_LOCK, "a") as fh:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{REAL_VLLM_LOCK} held by someone else too long") from None
                time.sleep(2.0)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
