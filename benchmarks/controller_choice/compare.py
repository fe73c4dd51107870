"""The measured ceiling, the fixed one with its feedback margin, or ceilings alone, in virtual time.

Runs kvgate's policy, behind the gateway's queue, on the virtual-time cluster of
`kvgate.bench.virtual` (the paged-KV engine simulator, scraped every 50 ms with 10 ms
delivery lag, clients with timeouts, retries and Retry-After) three ways:

* `measured`  - the default: the ceiling set by what each engine measures
  (`plan.ceiling`: above the cache for requests cheap to recompute while latency and
  goodput hold), and the margin;
* `margin`    - the fixed ceiling (`adaptive-fixed`), with `plan.margin.MarginController`
  lowering a node's ceilings for non-critical work while its measured usage overshoots
  the panic watermark;
* `ceilings`  - the fixed ceiling and no feedback at all: only the per-priority ceilings
  on the planned peak;

each on the cpu-tiny preset (2 engines of 4,096 KV tokens, the real vLLM CPU engine's
size) at several loads and seeds, and in regimes where the plan is wrong: exact prompt
costs; prompts *under*-estimated by 40 % (a chars-per-token ratio that has not learned
yet), the case feedback is meant to absorb; 30 % of the traffic invisible to the
gateway's books (it bypasses kvgate); and mixed priorities. Writes results.md next to
this file.

    python benchmarks/controller_choice/compare.py [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import zlib
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvgate.bench.metrics import summarize
from kvgate.bench.profiles import get_profile
from kvgate.bench.suite import RunSpec
from kvgate.bench.virtual import build_cluster, to_run_result
from kvgate.core.admission import Admit, Decision, Outcome
from kvgate.core.flow import FlowController, Waiter
from kvgate.core.policies.base import BasePolicy
from kvgate.core.request import AdmissionRequest, Priority, RequestCost
from kvgate.sim.runs import SHED, UNAVAILABLE, VirtualResult

# name -> (policy, feedback on)
CONFIGS: dict[str, tuple[str, bool]] = {
    "measured": ("adaptive", True),
    "margin": ("adaptive-fixed", True),
    "ceilings": ("adaptive-fixed", False),
}


_MIX = (Priority.CRITICAL,) * 2 + (Priority.STANDARD,) * 5 + (Priority.SHEDDABLE,) * 3


def _user(request_id: str) -> str:
    return request_id.split("#", 1)[0]


def _mixed_priority(user: str) -> Priority:
    """20 % critical, 50 % standard, 30 % sheddable, fixed by the user's id."""
    return _MIX[zlib.crc32(user.encode()) % len(_MIX)]


class _Seen:
    """Wraps the placement policy: prompts seen at `factor` of their size; with `hidden`,
    that share of users is forgotten by the policy right after admission (traffic that
    bypasses kvgate: the engine runs it, the books do not hold it)."""

    def __init__(self, inner: BasePolicy, factor: float, hidden: float) -> None:
        self._inner = inner
        self._factor = factor
        self._hidden = hidden

    def admit(
        self, request: AdmissionRequest, promised: Mapping[str, float] | None = None
    ) -> Decision:
        cost = request.cost
        seen = RequestCost(max(1, int(cost.prompt_tokens * self._factor)), cost.max_output_tokens)
        decision = self._inner.admit(dataclasses.replace(request, cost=seen), promised)
        user_hash = zlib.crc32(_user(request.request_id).encode())
        if isinstance(decision, Admit) and (user_hash % 1000) < self._hidden * 1000:
            self._inner.release(decision.ticket, Outcome.DONE)
        return decision

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Mixed:
    """Wraps the flow controller: each user's requests get its mixed priority."""

    def __init__(self, inner: FlowController) -> None:
        self._inner = inner

    def submit(self, request: AdmissionRequest) -> Decision | Waiter:
        priority = _mixed_priority(_user(request.request_id))
        return self._inner.submit(dataclasses.replace(request, priority=priority))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _refused(result: VirtualResult, mixed: bool) -> dict[Priority, float]:
    """Share of each priority's tries refused (429 or 503)."""
    tries = dict.fromkeys(Priority, 0)
    refused = dict.fromkeys(Priority, 0)
    for outcome in result.outcomes:
        priority = _mixed_priority(outcome.id) if mixed else Priority.parse(outcome.priority)
        tries[priority] += len(outcome.tries)
        refused[priority] += sum(t.outcome in (SHED, UNAVAILABLE) for t in outcome.tries)
    return {p: refused[p] / tries[p] if tries[p] else 0.0 for p in Priority}


def _run(spec: RunSpec, factor: float, mixed: bool, hidden: float) -> dict[str, Any]:
    cluster = build_cluster(spec)
    flow = cluster.policies[0]
    flow.policy = _Seen(flow.policy, factor, hidden)  # type: ignore[assignment]
    if mixed:
        cluster.policies[0] = _Mixed(flow)  # type: ignore[assignment]
    outcome = cluster.run()
    result = to_run_result(spec, outcome)
    row = summarize(result)
    for p, share in _refused(outcome, mixed).items():
        row[f"refused_{p.name.lower()}"] = share
    row["queued_max"] = max(result.series["queued"], default=0.0)
    kv = sorted(result.series["kv_usage_max"])
    row["kv_max_p99"] = kv[int(0.99 * (len(kv) - 1))] if kv else float("nan")
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    prof = get_profile("cpu-tiny")
    loads = [1.0, 2.0, 3.0]
    seeds = [1, 2] if args.quick else [1, 2, 3]
    duration = 60.0 if args.quick else 180.0
    base = RunSpec(
        preset="cpu-tiny",
        nodes=2,
        shape=prof.shape,
        load=1.0,
        seed=1,
        duration_s=duration,
        warmup_s=10.0,
        client=prof.client,
        slo=prof.slo,
        label="adaptive",
        policy="adaptive",
    )
    metrics = [
        "goodput_tok_s",
        "slo_attainment",
        "ttft_p99_s",
        "preemptions",
        "rejected_429",
        "queued_max",
        "kv_max_p99",
        "refused_critical",
        "refused_standard",
        "refused_sheddable",
    ]
    lines = [
        "# Ceiling and feedback comparison (kvgate behind the queue, virtual time)",
        "",
        "Command: `python benchmarks/controller_choice/compare.py"
        f"{' --quick' if args.quick else ''}`."
        f" cpu-tiny preset, 2 engines, profile mix at 1x scale, {duration:g} s per run"
        f" (10 s warm-up), seeds {seeds}; mean over seeds. `under-est.`: prompts admitted"
        " at 60 % of their real size. `shed_flips`: changes between zero and non-zero"
        " shedding probability in the 0.5 s series; `kv_max_p99`: p99 of the fullest"
        " engine's KV usage. `mixed prio.`: users 20 % critical, 50 % standard, 30 %"
        " sheddable (by id); `refused_*`: share of attempts of that priority refused"
        " (all traffic is standard in the other regimes). `hidden 30 %`: 30 % of users"
        " (by id) are dropped from the policy's books right after admission, i.e. load"
        " kvgate sees only through the engines' KV gauge.",
        "",
        "| regime | load | ceiling, feedback | " + " | ".join(metrics) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in metrics) + " |",
    ]
    regimes = (
        ("exact", 1.0, False, 0.0),
        ("under-est.", 0.6, False, 0.0),
        ("hidden 30 %", 1.0, False, 0.3),
        ("mixed prio.", 1.0, True, 0.0),
    )
    for regime, factor, mixed, hidden in regimes:
        for load in loads:
            for name, (policy, feedback) in CONFIGS.items():
                rows = [
                    _run(
                        replace(
                            base,
                            load=load,
                            seed=seed,
                            feedback=feedback,
                            label=policy,
                            policy=policy,
                        ),
                        factor,
                        mixed,
                        hidden,
                    )
                    for seed in seeds
                ]
                cells = []
                for m in metrics:
                    value = statistics.fmean(float(r[m]) for r in rows)
                    cells.append(f"{value:.3g}")
                line = f"| {regime} | {load:g}x | {name} | " + " | ".join(cells) + " |"
                lines.append(line)
                print(line, flush=True)
    out = Path(__file__).with_name("results.md")
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
