"""A tenant's budgets as OpenAI's rate-limit headers, and what a request used of them.

Every answer to a tenant with a budget (`kvgate.core.budgets`), 200s, refusals and streams
alike, carries OpenAI's headers, in the response's headers:

    x-ratelimit-limit-requests      the requests the window allows (requests_per_minute)
    x-ratelimit-limit-tokens        the tokens the window allows
    x-ratelimit-remaining-requests  the requests left now
    x-ratelimit-remaining-tokens    the tokens left now
    x-ratelimit-reset-requests      the time until the requests' bucket is full again
    x-ratelimit-reset-tokens        the time until the tokens' bucket is full again

A reset is a duration as OpenAI writes it (`6m0s`, `1s`, `20ms`). With both a per-minute
and a per-day token budget, the headers tell the one with the least left: the one that
refuses first. A tenant without a requests (or tokens) budget gets no such headers.
"""

from __future__ import annotations

from kvgate.core.budgets import Budgets
from kvgate.core.request import AdmissionRequest
from kvgate.gateway.relay.call import AccessRecord

Headers = list[tuple[bytes, bytes]]

_NAMES = {
    unit: (
        f"x-ratelimit-limit-{unit}".encode(),
        f"x-ratelimit-remaining-{unit}".encode(),
        f"x-ratelimit-reset-{unit}".encode(),
    )
    for unit in ("requests", "tokens")
}


def rate_limit_headers(budgets: Budgets, tenant: str, now: float) -> Headers:
    """The `x-ratelimit-*` headers of `tenant` now (none without a budget)."""
    if not budgets.governs(tenant):
        return []
    out: Headers = []
    for unit, status in sorted(budgets.status(tenant, now).items()):
        limit, remaining, reset = _NAMES[unit]
        out.append((limit, str(int(status.limit)).encode()))
        out.append((remaining, str(int(status.remaining)).encode()))
        out.append((reset, duration(status.reset_s).encode()))
    return out


def duration(seconds: float) -> str:
    """`seconds` as OpenAI writes a reset: `20ms` below a second, else `1.5s`, `6m0s`,
    `1h2m3s` (to the millisecond)."""
    ms = max(0, round(seconds * 1000))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{secs}"
    return f"{minutes}m{secs}" if minutes else secs


def tokens_used(record: AccessRecord, request: AdmissionRequest) -> int:
    """What a request that reached an engine used, for its tenant's budgets: its prompt
    and output as the engine's `usage` counted them (a usage without output, e.g. an
    embedding's: its prompt); for a stream without usage (cut short, or an engine that
    does not report it), its prompt as costed and the tokens relayed; for an error the
    engine answered, nothing; for an answer not read whole, all it was allowed (what the
    engine produced is unknown)."""
    cost = request.cost
    prompt = record.prompt_tokens if record.prompt_tokens is not None else cost.prompt_tokens
    if record.completion_tokens is not None:
        return prompt + record.completion_tokens
    if record.streamed:
        return prompt + record.events
    if record.response_done:
        if record.status >= 400:
            return 0
        if record.prompt_tokens is not None:
            return prompt
    return cost.total
