"""Which limit algorithm between the watermarks? PID vs Gradient2 vs none, in virtual time.

Runs the `adaptive` policy on the virtual-time cluster of `kvgate.bench.virtual` (the
paged-KV engine simulator, scraped every 50 ms with 10 ms delivery lag, clients with
timeouts, retries and Retry-After) with three limit algorithms:

* `pid`       - the default (`limits.PidLimit`);
* `gradient`  - `limits.GradientLimit`, Netflix Gradient2 transposed to KV usage;
* `ceilings`  - no feedback at all (all gains 0): only the per-priority ceilings;

each on the cpu-tiny preset (2 engines of 4,096 KV tokens, the real vLLM CPU engine's
size) at several loads and seeds, and in two prediction regimes: exact prompt costs, and
prompts *under*-estimated by 40 % (a chars-per-token ratio that has not learned yet), the
case feedback is meant to absorb, and with 30 % of the traffic invisible to the
gateway's books (it bypasses kvgate). Writes results.md next to this file.

    /work/venv/bin/python benchmarks/controller_choice/compare.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import zlib
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvgate.bench.metrics import summarize
from kvgate.bench.profiles import get_profile
from kvgate.bench.suite import RunSpec
from kvgate.bench.virtual import build_cluster, to_run_result
from kvgate.core.admission import Outcome
from kvgate.core.request import Priority, RequestCost

CONFIGS: dict[str, dict[str, Any]] = {
    "pid": {"controller": "pid"},
    "gradient": {"controller": "gradient"},
    "ceilings": {"controller": "pid", "controller_kp": 0, "controller_ki": 0, "controller_kd": 0},
}


_MIX = (Priority.CRITICAL,) * 2 + (Priority.STANDARD,) * 5 + (Priority.SHEDDABLE,) * 3


class _Wrapped:
    """Wraps a policy: prompts seen at `factor` of their size; optionally mixed priorities.

    With `mixed`, a user's priority is fixed by its id (20 % critical, 50 % standard,
    30 % sheddable) and refusals are counted per priority. With `hidden`, that share of
    users is forgotten by the policy right after admission (traffic that bypasses kvgate).
    """

    def __init__(self, inner: Any, factor: float, mixed: bool, hidden: float = 0.0) -> None:
        self._inner = inner
        self._factor = factor
        self._mixed = mixed
        self._hidden = hidden
        self.tries = {p: 0 for p in Priority}
        self.refused = {p: 0 for p in Priority}

    def admit(
        self, request_id: str, cost: RequestCost, priority: Priority, candidates: Sequence[str]
    ) -> Any:
        seen = RequestCost(max(1, int(cost.prompt_tokens * self._factor)), cost.max_output_tokens)
        if self._mixed:
            user = request_id.split("#", 1)[0]
            priority = _MIX[zlib.crc32(user.encode()) % len(_MIX)]
        decision = self._inner.admit(request_id, seen, priority, candidates)
        user_hash = zlib.crc32(request_id.split("#", 1)[0].encode())
        if hasattr(decision, "ticket") and (user_hash % 1000) < self._hidden * 1000:
            # The engine runs it, but the gateway's books forget it at once: load kvgate
            # cannot see except through the engine's own KV gauge.
            self._inner.release(decision.ticket, Outcome.DONE)
        self.tries[priority] += 1
        self.refused[priority] += not hasattr(decision, "ticket")
        return decision

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _run(spec: RunSpec, factor: float, mixed: bool, hidden: float) -> dict[str, Any]:
    cluster = build_cluster(spec)
    wrapped = _Wrapped(cluster.policies[0], factor, mixed, hidden)
    cluster.policies[0] = wrapped  # type: ignore[assignment]
    result = to_run_result(spec, cluster.run())
    row = summarize(result)
    for p in Priority:
        tries = wrapped.tries[p]
        row[f"refused_{p.name.lower()}"] = wrapped.refused[p] / tries if tries else 0.0
    shed = result.series["shed_prob"]
    row["shed_flips"] = sum(1 for a, b in itertools.pairwise(shed) if (a > 0) != (b > 0))
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
        "shed_flips",
        "kv_max_p99",
        "refused_critical",
        "refused_standard",
        "refused_sheddable",
    ]
    lines = [
        "# Limit algorithm comparison (adaptive policy, virtual time)",
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
        "| regime | load | limit | " + " | ".join(metrics) + " |",
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
            for name, overrides in CONFIGS.items():
                rows = [
                    _run(
                        replace(base, load=load, seed=seed, policy_overrides=overrides),
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
