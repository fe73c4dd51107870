"""`kvgate status`: what a running gateway sees, as a table in the terminal.

It reads `GET /admin/state` (the same JSON the dashboard streams), so an operator on a
jump host with only `ssh` gets the same facts as the browser: per node what the engine
reports and what kvgate predicts, and what admission is doing about it. `--watch` redraws
every `--interval` seconds and adds per-second rates derived from the counters.

Which gateway, and its admin token, come from the same places as for `kvgate serve`, in
the same order: the flags (`--url`, or `--port` for the configured host; `--admin-token`),
then the `KVGATE_*` environment, then the file `--config` names (`server.listen`,
`server.admin_token`). A refusal says what the gateway said and what to do about it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from kvgate.gateway.ops.tenants import NO_KEY

PRIORITIES = ("critical", "standard", "sheddable")
STATE_STYLE = {
    "ok": "green",
    "high": "yellow",
    "panic": "bold red",
    "thrashing": "bold magenta",
    "stale": "bold white on red",
    "dead": "bold white on red",
    "lagging": "cyan",
    "unknown": "dim",
}


#: What to do about an admin refusal, by the error `code` the gateway answered.
_ADMIN_HINTS = {
    "admin_disabled": "the gateway has API keys and no admin token, so its admin routes are"
    " closed: set server.admin_token in its configuration (or KVGATE_SERVER__ADMIN_TOKEN),"
    " restart it, and give the same token here (--admin-token, the environment or --config)",
    "invalid_admin_token": "give the gateway's server.admin_token: --admin-token,"
    " KVGATE_SERVER__ADMIN_TOKEN or --config FILE",
}


class StatusError(Exception):
    """The gateway could not be read; the message says why, for a human."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        help="gateway base URL (default: server.listen of the environment and --config,"
        " http://127.0.0.1:8080 without either)",
    )
    parser.add_argument(
        "--port", type=int, help="the gateway's port on this host (replaces server.listen's)"
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="the gateway's YAML config file: its server.listen and server.admin_token"
        " (the environment and the flags beat it, as for kvgate serve)",
    )
    parser.add_argument("--watch", action="store_true", help="refresh until interrupted")
    parser.add_argument(
        "--interval", type=float, default=1.0, help="seconds between refreshes (default: 1)"
    )
    parser.add_argument(
        "--admin-token",
        help="token of the admin routes (default: server.admin_token of"
        " $KVGATE_SERVER__ADMIN_TOKEN and --config)",
    )
    parser.add_argument(
        "--timeout", type=float, default=3.0, help="HTTP timeout in seconds (default: 3)"
    )
    parser.add_argument("--count", type=int, default=None, help="with --watch: stop after N")
    parser.add_argument("--json", action="store_true", help="print the raw state as JSON")


def _console() -> Console:
    """A terminal keeps its width; piped output gets room for the whole node table."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 170))
    return console


def run(args: argparse.Namespace) -> int:
    console = _console()
    if args.interval <= 0 or args.timeout <= 0:
        console.print("[red]error:[/] --interval and --timeout must be positive")
        return 2
    if args.count is not None and args.count < 1:
        console.print("[red]error:[/] --count must be at least 1")
        return 2
    if args.port is not None and (args.url or not 0 < args.port < 65536):
        console.print("[red]error:[/] --port takes 1-65535, and not with --url")
        return 2
    try:
        args.url, args.admin_token = target(args)
    except StatusError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}")
        return 2
    if args.watch:
        return _watch(args, console)
    try:
        state = fetch_state(args.url, args.admin_token, args.timeout)
    except StatusError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}")
        return 1
    if args.json:
        console.print_json(data=state)
    else:
        console.print(render(state))
    return 0


def target(args: argparse.Namespace) -> tuple[str, str | None]:
    """The gateway's base URL and admin token: the flags, else the environment, else the
    `--config` file (see the module docstring). Raises StatusError for a configuration
    that cannot be read."""
    if args.url and args.admin_token:
        return args.url, args.admin_token
    from kvgate.config import ConfigError, load_config
    from kvgate.gateway.settings import local_url

    try:
        server = load_config(args.config).server
    except ConfigError as exc:
        raise StatusError(f"invalid configuration: {exc}") from None
    token = args.admin_token or server.admin_token
    if args.url:
        return args.url, token
    host, port = server.address
    port = port if args.port is None else args.port
    return local_url(host, port, tls=bool(server.certfile and server.keyfile)), token


def fetch_state(url: str, token: str | None = None, timeout: float = 3.0) -> dict[str, Any]:
    """GET `<url>/admin/state` as a dict, or raise StatusError with a readable reason."""
    endpoint = url.rstrip("/") + "/admin/state"
    request = urllib.request.Request(endpoint, headers={"Accept": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        raise StatusError(refusal(endpoint, exc, token_sent=bool(token))) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise StatusError(f"cannot reach the gateway at {endpoint}: {reason}") from None
    try:
        state = json.loads(body)
    except ValueError:
        raise StatusError(f"{endpoint} did not answer JSON") from None
    if not isinstance(state, dict):
        raise StatusError(f"{endpoint} answered JSON that is not an object")
    return state


def refusal(endpoint: str, exc: urllib.error.HTTPError, *, token_sent: bool) -> str:
    """What the gateway answered (its message and code, whole) and, for an admin refusal,
    what to do about it."""
    message = code = None
    with contextlib.suppress(Exception):
        error = json.loads(exc.read())["error"]
        message, code = error.get("message"), error.get("code")
    said = f"{endpoint} answered {exc.code} {exc.reason}"
    if isinstance(message, str) and message:
        said += f": {message}"
    if isinstance(code, str) and code:
        said += f" ({code})"
    if exc.code not in (401, 403):
        return said
    if code == "admin_disabled":
        return f"{said}; {_ADMIN_HINTS['admin_disabled']}"
    if token_sent:
        return f"{said}; the token given is not the gateway's server.admin_token"
    return f"{said}; {_ADMIN_HINTS['invalid_admin_token']}"


def normalize(raw: dict[str, Any]) -> dict[str, Any]:
    """One flat shape from the gateway's nested state or a flat one.

    The gateway serves `{"time", "policy": <policy snapshot>, "scraper", "gateway":
    <counters>}`; a bare policy snapshot has its keys at the top. Both read the same here.
    """
    policy = _obj(raw.get("policy"))
    nested = policy if ("nodes" in policy or "controller" in policy) else None
    base = nested if nested is not None else raw
    name = nested.get("policy", nested.get("name")) if nested is not None else raw.get("policy")
    if isinstance(name, dict):
        name = name.get("name")
    return {
        "policy": name if isinstance(name, str) else None,
        "time": raw.get("time", base.get("time")),
        "nodes": _obj(base.get("nodes")),
        "controller": _obj(base.get("controller")),
        "queue": _obj(base.get("queue")),
        "in_flight_requests": base.get("in_flight_requests"),
        "released_tokens_per_s": base.get("released_tokens_per_s"),
        "counters": _obj(raw.get("counters")) or _obj(raw.get("gateway")),
        "scrape": _obj(raw.get("scrape")) or _obj(raw.get("scraper")),
        "cluster": _obj(raw.get("cluster")),
        "tenants": _obj(raw.get("tenants")),
        "refused_peak": _obj(base.get("refused_peak")),
    }


# ---------------------------------------------------------------- rates (watch mode)


@dataclass(frozen=True, slots=True)
class Totals:
    """The cumulative counters rates are derived from."""

    at: float
    admitted: dict[str, float]
    rejected: dict[str, float]
    cancellations: float


def totals(state: dict[str, Any], at: float) -> Totals:
    """Admitted/rejected per priority and cancellations, from the gateway's counters."""
    counters = normalize(state)["counters"]
    admitted = dict.fromkeys(PRIORITIES, 0.0)
    rejected = dict.fromkeys(PRIORITIES, 0.0)
    for key, value in _obj(counters.get("admissions")).items():
        decision, _, rest = str(key).partition("|")
        priority = rest.partition("|")[0].lower()
        target = admitted if decision.lower().startswith(("admit", "accept")) else rejected
        if priority in target:
            target[priority] += _sum(value)
    return Totals(at, admitted, rejected, _sum(counters.get("cancellations")))


def rates(old: Totals | None, new: Totals) -> dict[str, float] | None:
    """Per-second rates between two readings; None before the second one or after a reset."""
    if old is None or new.at <= old.at:
        return None
    span = new.at - old.at
    out: dict[str, float] = {}
    for prio in PRIORITIES:
        out[f"admitted_{prio}"] = (new.admitted[prio] - old.admitted[prio]) / span
        out[f"rejected_{prio}"] = (new.rejected[prio] - old.rejected[prio]) / span
    out["cancellations"] = (new.cancellations - old.cancellations) / span
    return None if any(v < 0 for v in out.values()) else out


# ---------------------------------------------------------------- rendering


def render(state: dict[str, Any], per_second: dict[str, float] | None = None) -> RenderableType:
    """The whole screen: cluster summary, then one row per node (worst first)."""
    state = normalize(state)
    parts: list[RenderableType] = [_cluster_table(state, per_second)]
    refused = _refused_peak(state["refused_peak"])
    if refused is not None:
        parts.append(refused)
    if state["cluster"]:
        parts.append(_replica_table(state["cluster"]))
    tenants = _tenant_table(state["tenants"])
    if tenants is not None:
        parts.append(tenants)
    parts.append(_node_table(state))
    return Group(*parts)


def _refused_peak(refused: dict[str, Any]) -> Text | None:
    """The planned peak of the last refusal by the plan (None before any): the node that
    came closest, what the plan foresaw there with the request, and what it reported."""
    peak = _num(refused.get("planned_peak"))
    if peak is None:
        return None
    usage = _num(refused.get("kv_usage"))
    reported = "" if usage is None else f" (its engine reported {_pct(usage)})"
    return Text(
        f"last refused by the plan ({refused.get('priority', '?')},"
        f" {_fmt(_num(refused.get('age_s')))} s ago): {refused.get('node', '?')} planned"
        f" {_pct(peak)} of its KV cache with it, over its"
        f" {_pct(_num(refused.get('ceiling')))} ceiling{reported}",
        style="yellow",
    )


def _tenant_table(tenants: dict[str, Any]) -> Table | None:
    """One row per tenant, with the figures the gateway lists in `columns` (see
    kvgate.gateway.ops.tenants); None when the gateway sends no such table."""
    columns = [c for c in tenants.get("columns") or [] if isinstance(c, list) and len(c) == 2]
    rows = [_obj(row) for row in tenants.get("rows") or []]
    if not columns or not rows:
        return None
    table = Table(title=f"tenants ({len(rows)})", show_header=True)
    table.add_column("tenant")
    for _, heading in columns:
        table.add_column(str(heading), justify="right")
    for row in rows:
        name = str(row.get("tenant") or "") or NO_KEY
        table.add_row(name, *(_fmt(_num(row.get(str(key)))) for key, _ in columns))
    return table


def _replica_table(cluster: dict[str, Any]) -> RenderableType:
    """The replicas sharing this gateway's admission state, and who polls which engine;
    then the store's last error, whole, on lines of its own."""
    sync = _obj(cluster.get("sync"))
    health = str(cluster.get("state", "?"))
    style = {"synced": "green", "isolated": "bold red"}.get(health, "yellow")
    last = _num(sync.get("last_latency_ms"))
    title = Text.assemble(
        f"replicas ({_fmt(_num(cluster.get('replicas')))}) · store {cluster.get('store', '?')} ",
        (health.upper(), style),
        f" · sync {_fmt(last)} ms" if last is not None else "",
    )
    table = Table(title=title, show_header=True)
    for column in ("replica", "host", "pid", "state", "owns", "polls"):
        table.add_column(column, justify="right" if column == "pid" else "left")
    for member in cluster.get("members") or []:
        member = _obj(member)
        mark = " (this one)" if member.get("self") else ""
        pid = _num(member.get("pid"))
        table.add_row(
            f"{member.get('id', '?')}{mark}",
            str(member.get("host") or ""),
            "–" if pid is None else str(int(pid)),  # an id: never abbreviated
            str(member.get("state") or ""),
            _fmt(len(member.get("owns") or [])),
            _fmt(len(member.get("scrapes") or [])),
        )
    if not sync.get("last_error"):
        return table
    return Group(table, Text(f"last store error: {sync['last_error']}", style="yellow"))


def _cluster_table(state: dict[str, Any], per_second: dict[str, float] | None) -> Table:
    ctl = _obj(state.get("controller"))
    queue = _obj(state.get("queue"))
    bands = _obj(queue.get("bands"))
    policy = state.get("policy")
    table = Table(title=f"kvgate · policy {policy or '?'}", show_header=True, expand=False)
    for column in ("", *PRIORITIES, "total"):
        table.add_column(column, justify="right" if column else "left")
    waiting = [_num(_obj(bands.get(p)).get("waiting")) for p in PRIORITIES]
    table.add_row("waiting in queue", *(_fmt(w) for w in waiting), _fmt(_num(queue.get("waiting"))))
    oldest = [_num(_obj(bands.get(p)).get("oldest_s")) for p in PRIORITIES]
    table.add_row("oldest wait s", *(_fmt(o) for o in oldest), "")
    count = totals(state, 0.0)
    for label, source in (("admitted", count.admitted), ("rejected", count.rejected)):
        cells = [_fmt(source[p]) for p in PRIORITIES]
        table.add_row(f"{label} (total)", *cells, _fmt(sum(source.values())))
        if per_second is not None:
            per = [per_second[f"{label}_{p}"] for p in PRIORITIES]
            table.add_row(f"{label} /s", *(_fmt(v) for v in per), _fmt(sum(per)))
    table.add_row("in-flight tokens", "", "", "", _fmt(_num(ctl.get("in_flight_tokens"))))
    table.add_row("waiting tokens", "", "", "", _fmt(_num(queue.get("tokens"))))
    table.add_row("in-flight requests", "", "", "", _fmt(_num(state.get("in_flight_requests"))))
    table.add_row("released tokens /s", "", "", "", _fmt(_num(state.get("released_tokens_per_s"))))
    cancel = _fmt(count.cancellations)
    if per_second is not None:
        cancel += f" ({_fmt(per_second['cancellations'])}/s)"
    table.add_row("cancellations propagated", "", "", "", cancel)
    counters = normalize(state)["counters"]
    handed_out = _num(counters.get("retry_after_count"))
    if handed_out is not None:  # gateways that count the Retry-After headers they send
        seconds = _num(counters.get("retry_after_sum_s"))
        mean = f" (mean {seconds / handed_out:.1f} s)" if seconds is not None and handed_out else ""
        table.add_row("Retry-After handed out", "", "", "", _fmt(handed_out) + mean)
    by_reason = rejection_reasons(state)
    if by_reason:
        ranked = sorted(by_reason.items(), key=lambda item: -item[1])
        table.caption = "rejected by reason: " + " · ".join(f"{r} {_fmt(n)}" for r, n in ranked)
    return table


def rejection_reasons(state: dict[str, Any]) -> dict[str, float]:
    """Total rejections per reason, from the `decision|priority|reason` counters."""
    out: dict[str, float] = {}
    for key, value in _obj(normalize(state)["counters"].get("admissions")).items():
        decision, _, rest = str(key).partition("|")
        if decision.lower().startswith(("admit", "accept")):
            continue
        reason = rest.partition("|")[2] or "other"
        out[reason] = out.get(reason, 0.0) + _sum(value)
    return out


def _node_table(state: dict[str, Any]) -> Table:
    nodes = {str(k): _obj(v) for k, v in _obj(state.get("nodes")).items()}
    scrape = _obj(_obj(state.get("scrape")).get("nodes"))
    table = Table(title=f"nodes ({len(nodes)})", show_header=True)
    columns = (
        "node",
        "state",
        "age",
        "KV rep.",
        "KV pred.",
        "ceiling",
        "reserved tok",
        "in-flight",
    )
    for column in columns:
        table.add_column(column, justify="left" if column in ("node", "state") else "right")
    for column in ("running", "waiting", "iter. latency", "scrape"):
        table.add_column(column, justify="right")
    polled_here = _polled_here(state)
    for node_id in sorted(nodes, key=lambda n: (_severity(nodes[n]), _natural(n))):
        cells = _node_cells(node_id, nodes[node_id], _obj(scrape.get(node_id)))
        if polled_here is not None and node_id not in polled_here:
            cells[-1] = "shared"  # polled by another replica, its samples taken from the store
        table.add_row(*cells)
    return table


def _polled_here(state: dict[str, Any]) -> set[str] | None:
    """The engines this replica polls itself (None: not one of several replicas)."""
    for member in _obj(state.get("cluster")).get("members") or []:
        if _obj(member).get("self"):
            return set(_obj(member).get("scrapes") or [])
    return None


def _node_cells(node_id: str, node: dict[str, Any], scrape: dict[str, Any]) -> list[Any]:
    state = _node_state(node)
    sample = _obj(node.get("sample"))
    latency = _num(sample.get("iteration_latency_s"))
    scrape_text = _ms(_num(scrape.get("last_latency_s")))
    failures = _num(scrape.get("consecutive_failures"))
    if failures:
        scrape_text += f" ✗{_fmt(failures)}"
    if scrape.get("page_note"):
        # A node that could be polled on the narrowed page but is not: the reason is in
        # /admin/state (`kvgate status --json`).
        scrape_text += " (full page)"
    style = STATE_STYLE.get(state, "")
    return [
        Text(node_id, style="bold red" if state in ("stale", "dead") else ""),
        Text(state.upper(), style=style),
        _age(_num(node.get("age_s"))),
        _pct(_num(sample.get("kv_usage"))),
        _pct(_num(node.get("predicted_usage"))),
        _ceiling(node),
        _fmt(_num(node.get("reserved_tokens"))),
        _fmt(_num(node.get("in_flight"))),
        _fmt(_num(sample.get("running"))),
        _fmt(_num(sample.get("waiting"))),
        _ms(latency),
        scrape_text,
    ]


def _ceiling(node: dict[str, Any]) -> str:
    """The planned peak the node may reach with standard work, and why it is there."""
    reason = node.get("ceiling_reason")
    value = _pct(_num(node.get("ceiling")))
    return f"{value} {reason}" if isinstance(reason, str) and reason else value


def _watch(args: argparse.Namespace, console: Console) -> int:
    """Redraw until Ctrl-C (or `--count` frames); an unreachable gateway is shown, not fatal.

    On a terminal each frame replaces the last; redirected to a file or a pipe, frames are
    appended one after the other, each flushed at once (a `tail -f` sees it as it comes).
    """
    from rich.live import Live

    previous: Totals | None = None
    shown = 0
    live = Live(console=console, auto_refresh=False, screen=False) if console.is_terminal else None

    def show(frame: RenderableType) -> None:
        if live is not None:
            live.update(frame, refresh=True)
        else:
            console.print(frame)
            console.file.flush()

    with live if live is not None else contextlib.nullcontext():
        try:
            while args.count is None or shown < args.count:
                started = time.monotonic()
                try:
                    state = fetch_state(args.url, args.admin_token, args.timeout)
                except StatusError as exc:
                    show(Text(f"error: {exc} (retrying)", style="red"))
                    previous = None
                else:
                    current = totals(state, started)
                    show(render(state, rates(previous, current)))
                    previous = current
                shown += 1
                if args.count is not None and shown >= args.count:
                    break
                time.sleep(max(0.0, args.interval - (time.monotonic() - started)))
        except KeyboardInterrupt:
            pass
    return 0


# ---------------------------------------------------------------- small helpers

_SEVERITY = {
    "panic": 0,
    "thrashing": 1,
    "dead": 2,
    "stale": 3,
    "lagging": 4,
    "high": 5,
    "unknown": 6,
    "ok": 7,
}


def _node_state(node: dict[str, Any]) -> str:
    state = node.get("state")
    if isinstance(state, str) and state.lower() in _SEVERITY:
        return state.lower()
    return "stale" if node.get("fresh") is False else "unknown"


def _severity(node: dict[str, Any]) -> int:
    return _SEVERITY[_node_state(node)]


def _natural(text: str) -> tuple[Any, ...]:
    """`node-2` before `node-10`."""
    parts: list[Any] = []
    digits = ""
    for char in text + "\0":
        if char.isdigit():
            digits += char
            continue
        if digits:
            parts.append((0, int(digits), ""))
            digits = ""
        parts.append((1, 0, char))
    return tuple(parts)


def _obj(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if value == value and abs(value) != float("inf") else None


def _sum(value: Any) -> float:
    """Every number under a value: a number, or nested dicts of numbers."""
    number = _num(value)
    if number is not None:
        return number
    return sum(_sum(v) for v in value.values()) if isinstance(value, dict) else 0.0


def _fmt(value: float | None) -> str:
    if value is None:
        return "–"
    if abs(value) >= 1e6:
        return f"{value / 1e6:.1f}M"
    if abs(value) >= 1e4:
        return f"{value / 1e3:.1f}k"
    if value == int(value) or abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.1f}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.0f}%"


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:.1f} ms"


def _age(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds:.1f} s"
