"""A live run: real HTTP clients with real client behaviour, against real processes.

`run_live` plays a scenario's arrivals in real time (`kvgate.bench.live.client`) while
every engine's `/metrics` and the gateway's view are polled for the time series
(`kvgate.bench.live.poll`), and turns what the clients got and the engines' counters into
a `RunResult`. On an engine without a zombie counter the zombie figure is an upper bound,
split as far as observable by `zombie_account` with kvgate's own count of what it relayed
to clients that left. The processes a run talks to are started in `kvgate.bench.live.driver`.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np

from kvgate.bench.gateway_queue import WaitHistogram, queue_summary
from kvgate.bench.live.client import ClientRun, LiveTarget, play_user, prompt_ids
from kvgate.bench.live.poll import COUNTERS, poll_engines, queue_marks, relay_counters, scrape
from kvgate.bench.metrics import EngineTotals, RunResult, Slo
from kvgate.bench.workload import Arrival
from kvgate.sim.runs import ClientModel


@dataclass(frozen=True)
class LiveOptions:
    """What a live run is (its label in the report) and how it is played."""

    policy: str
    load: float
    seed: int
    preset: str
    duration_s: float
    warmup_s: float
    slo: Slo
    bursts: Sequence[float] = ()
    #: After the last arrival: how long tries may go on (default: the client's timeout).
    drain_s: float | None = None
    #: How often the engines and the gateway are polled for the time series.
    step_s: float = 0.5


async def run_live(
    arrivals: Sequence[Arrival], client: ClientModel, target: LiveTarget, options: LiveOptions
) -> RunResult:
    """Play `arrivals` against `target` in real time and record a `RunResult`."""
    o = options
    drain = client.timeout_s if o.drain_s is None else o.drain_s
    load_before = os.getloadavg()[0]
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn) as session:
        before = await asyncio.gather(*(scrape(session, e) for e in target.engines))
        marks_before = await queue_marks(session, target.gateway)
        shared = ClientRun(
            time.monotonic(),
            retry_rng=np.random.default_rng([o.seed, 7]),
            says_timeout=client.says_timeout,
        )
        stop_at = o.duration_s + drain
        series: dict[str, list[float]] = {
            k: [] for k in ("t", "kv_usage_max", "kv_usage_mean", "running", "waiting")
        }
        series["preemptions"] = []
        stop = asyncio.Event()
        poller = asyncio.create_task(poll_engines(session, target, shared, o.step_s, series, stop))
        users = [
            play_user(
                session,
                a,
                client,
                target,
                shared,
                prompt_ids(a.prompt_tokens, zlib.crc32(f"{o.seed}:{a.id}".encode())),
                stop_at,
            )
            for a in arrivals
            if a.t < o.duration_s
        ]
        requests = await asyncio.gather(*users)
        stop.set()
        await poller
        await asyncio.sleep(1.0)  # let aborted requests leave the engines' counters
        after = await asyncio.gather(*(scrape(session, e) for e in target.engines))
        marks_after = await queue_marks(session, target.gateway)
    relay = relay_counters(marks_after[0])
    deltas = {
        n: sum(a.get(n, 0.0) - b.get(n, 0.0) for a, b in zip(after, before, strict=True))
        for n in COUNTERS
    }
    account = None if target.zombie_from_counter else zombie_account(deltas, shared, relay)
    return RunResult(
        policy=o.policy,
        load=o.load,
        seed=o.seed,
        preset=o.preset,
        nodes=len(target.engines),
        duration_s=o.duration_s,
        warmup_s=o.warmup_s,
        slo=o.slo,
        requests=list(requests),
        totals=_totals(deltas, account),
        series=series,
        bursts=list(o.bursts),
        extra={
            "delivered_tokens": shared.delivered,
            "engine_counters": deltas,
            "refusals_by_reason": dict(shared.refusals),
            **_queue_extra(target, series, marks_before, marks_after),
            **({} if account is None else {"zombie_account": account}),
            "notes": [
                f"{o.policy} @ {o.load:g}x: machine load average {load_before:.1f} before, "
                f"{os.getloadavg()[0]:.1f} after (2 cores shared with other work)",
                *([] if account is None else [zombie_note(o.policy, o.load, account)]),
            ],
            "_attempt_log": shared.log,  # not in results.json: every try that fell short
        },
    )


def _queue_extra(
    target: LiveTarget,
    series: dict[str, list[float]],
    before: tuple[dict[str, Any] | None, WaitHistogram],
    after: tuple[dict[str, Any] | None, WaitHistogram],
) -> dict[str, dict[str, float]]:
    """`gateway_queue` (see `kvgate.bench.gateway_queue`) for a run through a gateway, from
    its (state, wait histogram) read before and after the run."""
    if target.gateway is None:
        return {}
    waiting = [w for w in series.get("queued", ()) if not math.isnan(w)]
    peak = max(waiting, default=math.nan)
    waits = after[1].since(before[1])
    return {"gateway_queue": queue_summary(before[0], after[0], waits, peak)}


def zombie_account(
    deltas: dict[str, float], shared: ClientRun, relay: dict[str, int]
) -> dict[str, float]:
    """Split the tokens a real engine generated that no client read, as far as observable.

    A real engine has no zombie counter; vLLM counts a token when its API server takes it
    from the engine core, and stops counting a request when it aborts it. So

        undelivered = generated - whole answers read - tokens read by clients that left

    holds, besides zombie tokens (made after the client left, before the abort landed),
    tokens made *before* the client left that it never read: still in the engine's server,
    in the relay, or in socket buffers of a client that lagged. The relay counts the events
    it had passed on to clients that then left; those beyond what the clients read were
    made before they left, so they are not zombies. Converted to tokens at the departed
    clients' own tokens per event, they are subtracted to give `zombie_bound`, an upper
    bound of zombie tokens (the tokens made just before a client left that were still in
    the engine's server are in it too). Without a relay (`direct`) the bound is `undelivered`.
    """
    generated = deltas.get("vllm:generation_tokens_total", 0.0)
    finished = deltas.get("vllm:request_generation_tokens_sum", math.nan)
    undelivered = max(0.0, generated - shared.delivered_whole - shared.departed_tokens)
    per_event = shared.departed_tokens / shared.departed_events if shared.departed_events else 1.0
    unread_events = math.nan
    unread_tokens = 0.0
    if "client_gone_events" in relay:
        unread_events = float(max(0, relay["client_gone_events"] - shared.departed_events))
        unread_tokens = min(undelivered, unread_events * per_event)
    bound = undelivered - unread_tokens
    return {
        "generated": generated,
        "in_finished_requests": finished,
        "in_aborted_requests": generated - finished,
        "read_whole": float(shared.delivered_whole),
        "departures": float(shared.departures),
        "departed_midstream": float(shared.departed_midstream),
        "read_by_departed": float(shared.departed_tokens),
        "undelivered": undelivered,
        "relayed_unread_events": unread_events,
        "relayed_unread_tokens": unread_tokens,
        "events_after_client_gone": float(relay.get("events_after_client_gone", math.nan)),
        "zombie_bound": bound,
        "zombie_bound_per_departure": bound / shared.departures if shared.departures else 0.0,
    }


def zombie_note(policy: str, load: float, a: dict[str, float]) -> str:
    """One line of the report: where the tokens nobody read went."""
    text = (
        f"{policy} @ {load:g}x, zombie accounting: engine generated {a['generated']:,.0f} "
        f"tokens, whole answers read {a['read_whole']:,.0f}, {a['departures']:,.0f} tries "
        f"ended before their answer ({a['departed_midstream']:,.0f} mid-stream; they had read "
        f"{a['read_by_departed']:,.0f} tokens); nobody read {a['undelivered']:,.0f}"
    )
    if not math.isnan(a["relayed_unread_events"]):
        text += (
            f", of which ~{a['relayed_unread_tokens']:,.0f} in {a['relayed_unread_events']:,.0f} "
            f"events kvgate had relayed to clients still connected (made before they left); "
            f"events kvgate read after a client left: {a['events_after_client_gone']:,.0f}"
        )
    return (
        text + f"; zombie tokens at most {a['zombie_bound']:,.0f} "
        f"({a['zombie_bound_per_departure']:.1f} per try that ended early)"
    )


def _totals(deltas: dict[str, float], account: dict[str, float] | None) -> EngineTotals:
    """Engine totals; zombies from the engine's counter, or the bound of `zombie_account`."""
    zombies = (
        deltas.get("sim:zombie_tokens_total", 0.0) if account is None else account["zombie_bound"]
    )
    return EngineTotals(
        preemptions=int(deltas.get("vllm:num_preemptions_total", 0.0)),
        recomputed_tokens=int(deltas.get("sim:recomputed_tokens_total", 0.0)),
        zombie_tokens=round(zombies),
        generated_tokens=int(deltas.get("vllm:generation_tokens_total", 0.0)),
    )
