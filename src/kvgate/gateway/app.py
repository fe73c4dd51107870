"""The gateway as one raw ASGI application: a dict of routes, no framework on the hot path.

`Gateway(config)` builds the admission core (the flow controller around the placement
policy), the upstream pool, the model catalog, the relay and
the metrics; its ASGI lifespan (or `async with gateway.running():` in tests and embedders)
opens the upstream session and starts the scraper and background refreshes in a task group
the gateway owns, and tears all of it down on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import orjson

from kvgate.adapters.backend import Backend, unique
from kvgate.adapters.push import MAX_PUSH_BYTES, PushValidationError, parse_push
from kvgate.cluster.replica import join
from kvgate.cluster.sync import ClusterSync
from kvgate.cluster.telemetry import ClusterCollector
from kvgate.config import KvgateConfig
from kvgate.core.clock import Clock, MonotonicClock
from kvgate.core.cost import CostEstimator
from kvgate.core.flow import FlowController
from kvgate.core.policies import BasePolicy, build_policy
from kvgate.core.prefix.events import KVEventSink
from kvgate.gateway.engines.backend_set import BackendChange, diff_backends, restart_needed
from kvgate.gateway.engines.discovery import Discovery, Resolver, resolve_ipv4
from kvgate.gateway.engines.kv_events import KVEventSubscriber
from kvgate.gateway.engines.scraper import Scraper
from kvgate.gateway.http.asgi import ASGIApp, Receive, Scope, Send
from kvgate.gateway.http.body import ClientGone, read_body
from kvgate.gateway.http.errors import GatewayError, send_error, send_json
from kvgate.gateway.ops import dashboard
from kvgate.gateway.ops.history import ChartHistory
from kvgate.gateway.ops.telemetry import GatewayMetrics
from kvgate.gateway.ops.tenants import BudgetCollector, tenant_table
from kvgate.gateway.relay.relay import Relay
from kvgate.gateway.relay.upstream import ModelCatalog, Upstream, UpstreamPool
from kvgate.gateway.security.admin import AdminAccess, is_admin_path
from kvgate.gateway.security.auth import Security, TenantCollector
from kvgate.gateway.tokens.files import load_tokenizers

log = logging.getLogger(__name__)

#: The admin routes that change the gateway, and their 403 while no admin token is set.
_CONTROLS = {
    "/admin/signals": AdminAccess(True, "Pushed signals are disabled", "push_disabled"),
    "/admin/reload": AdminAccess(True, "Reloading is disabled", "reload_disabled"),
}


class Gateway:
    """kvgate's ASGI application. Inject `policy` (the placement inside the core's flow
    controller), `clock` or `estimator` to replace them.

    `load_config` re-reads the configuration the gateway was started from (its file, the
    environment and the command line): with it, SIGHUP and `POST /admin/reload` apply a
    changed list of backends, API keys and tenant limits without a restart (see
    kvgate.gateway.engines.backend_set). With `store.url` it is one replica of many that
    admit as one (kvgate.cluster); `replicas` is how many to assume while the store has
    never been reached (`kvgate serve --workers N`).
    """

    def __init__(
        self,
        config: KvgateConfig,
        *,
        policy: BasePolicy | None = None,
        clock: Clock | None = None,
        estimator: CostEstimator | None = None,
        load_config: Callable[[], KvgateConfig] | None = None,
        resolver: Resolver = resolve_ipv4,
        replicas: int = 1,
    ) -> None:
        self.config = config
        self._load_config = load_config
        self.clock = clock or MonotonicClock()
        # `discover: dns` entries have no backend until their first lookup (in `running`).
        self._resolver = resolver
        self.discovery = Discovery(config.backends, resolver)
        self.backends = self.discovery.backends()
        # Without API keys the front door is off; with them it authenticates every request
        # and names its tenant, whose limits the core's flow controller keeps. The admin
        # check guards every admin route either way.
        self.security = Security.from_config(config.auth, config.server.admin_token)
        self.admission = FlowController(
            policy or build_policy(config.admission, self.clock),
            config.queue,
            tenants=self.security.ledger,
            budgets=self.security.budgets,
        )
        for backend in self.backends:
            self.admission.add_node(backend.node_id)
        self.metrics = GatewayMetrics()
        self.metrics.policy_snapshot = self.admission.snapshot
        if self.security.tenants:
            self.metrics.registry.register(TenantCollector(self.security.ledger))
        budgets = self.security.budgets
        self.metrics.registry.register(BudgetCollector(lambda: budgets.snapshot(self.clock.now())))
        self.pool = UpstreamPool(self.backends)
        self.catalog = ModelCatalog(self.pool)
        self.catalog.bind(self.spawn)
        self.relay = Relay(
            Upstream(self.pool, self.catalog, config.upstream),
            self.admission,
            estimator or CostEstimator(config.admission),
            self.metrics,
            config.limits,
            self.spawn,
            # Read here, at startup: file I/O, and a bad file stops the start.
            load_tokenizers(config.admission.tokenizers),
        )
        self.scraper: Scraper | None = None
        #: Per backend with `kv_events`: its subscriber and task (started by `running`).
        self.kv_events: dict[str, tuple[KVEventSubscriber, asyncio.Task[Any]]] = {}
        #: The last minutes of what the dashboard charts (recorded by `running`).
        self.history = ChartHistory(self.state)
        #: With `store.url`: this replica's link to the others (started by `running`).
        self.cluster: ClusterSync | None = None
        self.replicas = replicas
        self._group: asyncio.TaskGroup | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self.routes: dict[tuple[str, str], ASGIApp] = {
            ("POST", "/v1/completions"): self.relay.completion,
            ("POST", "/v1/chat/completions"): self.relay.completion,
            ("GET", "/v1/models"): self._models,
            ("GET", "/healthz"): self._healthz,
            ("GET", "/readyz"): self._readyz,
            ("GET", "/admin/state"): self._state,
            ("POST", "/admin/signals"): self._signals,
            ("POST", "/admin/reload"): self._reload,
        }
        if not config.server.metrics_listen:  # else only on its own address: serve_metrics
            self.routes["GET", "/metrics"] = self._metrics
        self._merge_dashboard()
        self.routes = self.security.admin.protect_routes(self.routes, _CONTROLS)
        self._no_admin_route = self.security.admin.protect(self._no_route)
        self._paths = {path for _, path in self.routes}
        # A reload may change the keys, never switch them on or off (Security.update).
        self._front_door = self.security.front.enabled

    # ---- ASGI ---------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if self._front_door:
                await self.security.front(scope, receive, send, self._dispatch)
                return
            # The hot path: a known route is awaited from here, one coroutine less per request.
            handler = self.routes.get((scope["method"], scope["path"]))
            if handler is not None:
                await handler(scope, receive, send)
                return
        await self._dispatch(scope, receive, send)

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            path = scope["path"]
            handler = self.routes.get((scope["method"], path))
            if handler is not None:
                await handler(scope, receive, send)
            elif path.startswith("/v1/") and path not in self._paths:
                await self.relay.passthrough(scope, receive, send)
            elif is_admin_path(path):  # what exists under /admin is the admin's to learn
                await self._no_admin_route(scope, receive, send)
            else:
                await self._no_route(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _no_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        """405 for a known path asked with another method, else 404."""
        if scope["path"] in self._paths:
            message = f"Method {scope['method']} not allowed."
            await send_error(send, GatewayError(405, message, "method_not_allowed"))
        else:
            await send_error(send, GatewayError(404, f"No route {scope['path']}.", "not_found"))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        started = False
        try:
            async with self.running():
                started = True
                await send({"type": "lifespan.startup.complete"})
                try:
                    await receive()  # lifespan.shutdown
                except asyncio.CancelledError:
                    # A forced exit cancels this task instead of sending shutdown; the
                    # `running()` exit above still closes everything, quietly.
                    return
        except Exception as exc:
            log.exception("gateway lifespan failed")
            if not started:
                await send({"type": "lifespan.startup.failed", "message": str(exc)})
                return
        await send({"type": "lifespan.shutdown.complete"})

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Gateway]:
        """Open the upstream pool and run the background tasks until the block ends."""
        await self.pool.start()
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                try:
                    await self._discover()  # before the scraper: it starts with every node
                    self.spawn(self._watch_dns())
                    self._join_replicas()
                    self._start_scraper()
                    for backend in self.backends:
                        self._subscribe(backend)
                    self.spawn(self.catalog.refresh())
                    self.spawn(self.history.run())
                    yield self
                finally:
                    self._group = None
                    self.relay.cancel_all("shutdown")
                    for task in list(self._background):
                        task.cancel()
        finally:
            await self.pool.close()

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        """Run `coro` in the gateway's task group (owned, cancelled on shutdown)."""
        if self._group is None:
            task = asyncio.ensure_future(coro)
            task.cancel()  # nothing may outlive the gateway: refuse after shutdown
            return task
        task = self._group.create_task(_quiet(coro))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _join_replicas(self) -> None:
        """With a store: share admission state and engine samples with the other replicas."""
        if not self.config.store.url:
            return
        self.cluster = join(
            self.config.store.url,
            self.admission,
            self.clock,
            nodes=lambda: [b.node_id for b in self.backends],
            expected_members=self.replicas,
            settings=self.config.admission,
        )
        self.metrics.registry.register(ClusterCollector(self.cluster))
        self.spawn(self.cluster.run())

    def _start_scraper(self) -> None:
        cluster = self.cluster
        self.scraper = Scraper(
            self.backends,
            self.config.scrape,
            self.admission if cluster is None else cluster.sink,
            None,
            self.clock,
            stale_after_s=self.config.admission.stale_after_s,
            polls=None if cluster is None else cluster.scrapes,
        )
        self.metrics.scraper_stats = self.scraper.snapshot
        self.metrics.scraper_node_stats = self.scraper.stats
        self.spawn(self.scraper.run())

    # ---- backends while running --------------------------------------------------------------

    def set_backends(self, backends: Sequence[Backend]) -> BackendChange:
        """Serve `backends` from now on. Added nodes are scraped and routed to at once;
        removed ones get no new request, and the requests already on them run to their end.
        Unchanged nodes keep their state (samples, controller, connections)."""
        backends = unique(list(backends))  # two with one node id: a configuration error
        change = diff_backends(self.backends, backends)
        for old in (*change.removed, *(old for old, _ in change.replaced)):
            self._drop(old)
        for new in (*change.added, *(new for _, new in change.replaced)):
            self._join(new)
        before = {b.node_id: b for b in self.backends}  # an unchanged node keeps its adapter
        self.backends = [before[b.node_id] if before.get(b.node_id) == b else b for b in backends]
        log.info("backends %s", "unchanged" if change.empty else f"changed: {change.describe()}")
        return change

    def _subscribe(self, backend: Backend) -> None:
        """Follow the backend's KV events into the policy, when both have them."""
        policy = self.admission.policy
        if backend.kv_events is None or not isinstance(policy, KVEventSink):
            return
        try:
            subscriber = KVEventSubscriber(backend.node_id, backend.kv_events, policy.kv_events)
        except ImportError:
            log.error("kv_events of %s needs the kv-events extra (pyzmq, msgspec)", backend.node_id)
            return
        self.kv_events[backend.node_id] = (subscriber, self.spawn(subscriber.run()))

    def _drop(self, backend: Backend) -> None:
        gone = self.kv_events.pop(backend.node_id, None)
        if gone is not None:
            gone[1].cancel()
        if self.scraper is not None:
            self.scraper.remove(backend.node_id)
        self.pool.remove(backend.node_id)
        self.catalog.forget(backend.node_id)
        self.admission.remove_node(backend.node_id)

    def _join(self, backend: Backend) -> None:
        self.pool.add(backend)
        self.admission.add_node(backend.node_id)
        if self.scraper is not None:
            self.scraper.add(backend)
            self._subscribe(backend)
        self.spawn(self.catalog.learn(backend))

    async def _discover(self) -> None:
        """Look the dns entries up once and serve what they resolve to."""
        discovery = self.discovery
        if not discovery.dynamic or not await discovery.refresh():
            return
        if discovery is not self.discovery:  # a reload replaced it meanwhile
            return
        try:
            self.set_backends(discovery.backends())
        except ValueError as exc:
            log.error("discovery: %s; backends unchanged", exc)

    async def _watch_dns(self) -> None:
        while True:
            await asyncio.sleep(self.discovery.every_s)
            await self._discover()

    def reload(self) -> tuple[BackendChange, list[str]]:
        """Re-read the configuration and apply its backends, keys and tenant limits: (what
        changed in the backends, the sections that changed too but apply only at the next
        start). Raises, changing nothing, when the configuration cannot be read or names no
        backend."""
        try:
            if self._load_config is None:
                raise ReloadUnavailable("this gateway was not started from a configuration file")
            loaded = self._load_config()
            if not loaded.backends:
                raise ValueError("the configuration names no backend")
            discovery = Discovery(loaded.backends, self._resolver, previous=self.discovery)
            change = self.set_backends(discovery.backends())
        except Exception as exc:  # SIGHUP and the route both answer it; logged once, here
            log.error("reload refused, backends unchanged: %s", exc)
            raise
        self.discovery = discovery
        if discovery.dynamic:
            self.spawn(self._discover())  # a dns entry new to this file: look it up now
        later = restart_needed(self.config, loaded)
        applied: dict[str, Any] = {"backends": loaded.backends}
        # Keys and tenant limits too (a key file is read again even if its path is the same).
        if self.security.update(loaded.auth):
            applied["auth"] = loaded.auth
            later = [section for section in later if section != "auth"]
        self.config = self.config.model_copy(update=applied)
        if later:
            log.warning("reload: %s changed too; that applies at the next start", ", ".join(later))
        return change, later

    async def drain(self, timeout_s: float) -> None:
        """Let in-flight requests finish for up to `timeout_s`, then cancel the rest."""
        self.relay.accepting = False
        if await self.relay.wait_idle(timeout_s):
            return
        cancelled = self.relay.cancel_all("shutdown")
        log.warning("drain timeout: cancelled %d request(s) upstream", cancelled)
        await self.relay.wait_idle(2.0)

    # ---- small routes -------------------------------------------------------------------------

    async def _healthz(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, b'{"status":"ok"}')

    async def _readyz(self, scope: Scope, receive: Receive, send: Send) -> None:
        nodes = self.admission.snapshot().get("nodes", {})
        live = {nid: bool(state.get("live")) for nid, state in nodes.items()}  # fresh or lagging
        ready = any(live.values()) or (self.scraper is None and self.catalog.known)
        status: dict[str, Any] = {"ready": ready, "backends": live}
        cluster = self.cluster
        if cluster is not None and not cluster.ready:  # it admits nothing until it syncs
            status.update(ready=False, store=cluster.stats.last_error or "not reached yet")
            ready = False
        body = orjson.dumps(status)
        await send_json(send, 200 if ready else 503, body)

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = self.metrics.render()
        headers = [
            (b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def serve_metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI app of `server.metrics_listen`'s address: `GET /metrics`, nothing else."""
        if scope["type"] != "http":
            return
        if scope["path"] != "/metrics":
            await send_error(send, GatewayError(404, f"No route {scope['path']}.", "not_found"))
        elif scope["method"] != "GET":
            message = f"Method {scope['method']} not allowed."
            await send_error(send, GatewayError(405, message, "method_not_allowed"))
        else:
            await self._metrics(scope, receive, send)

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        models = await self.catalog.models()
        await send_json(send, 200, orjson.dumps({"object": "list", "data": models}))

    def state(self) -> dict[str, Any]:
        """Everything `/admin/state` and the dashboard show."""
        policy = self.admission.snapshot()
        return {
            "time": self.clock.now(),
            "policy": policy,
            "tenants": tenant_table(
                self.metrics.tenants,
                policy["tenants"],
                policy["queue"]["tenants"],
                policy["budgets"],
            ),
            "scraper": None if self.scraper is None else self.scraper.snapshot(),
            # Each engine's KV event stream: batches, gaps, replays, restarts seen.
            "kv_events": {node: sub.snapshot() for node, (sub, _) in self.kv_events.items()},
            "costs": self.relay.costs_snapshot(),
            "cluster": None if self.cluster is None else self.cluster.snapshot(),
            "gateway": {
                **self.metrics.counters(),
                "backends": [
                    {"node_id": b.node_id, "url": b.base_url, "engine": b.engine}
                    for b in self.backends
                ],
            },
        }

    async def _state(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, orjson.dumps(self.state(), option=orjson.OPT_NON_STR_KEYS))

    async def _signals(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Samples pushed by sidecars, for engines kvgate cannot scrape itself."""
        try:
            body = await read_body(receive, MAX_PUSH_BYTES)
            accepted = self._apply_push(body)
        except GatewayError as err:
            await send_error(send, err)
            return
        except ClientGone:  # nobody is left to answer
            return
        await send_json(send, 202, orjson.dumps({"accepted": accepted}))

    async def _reload(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Re-read the configuration and apply its backends (as SIGHUP does)."""
        try:
            change, later = self.reload()
        except ReloadUnavailable as exc:
            await send_error(send, GatewayError(409, f"{exc}.", "reload_unavailable"))
            return
        except Exception as exc:  # an unreadable or invalid file: nothing was changed
            message = f"The configuration was not applied: {exc}"
            await send_error(send, GatewayError(400, message, "invalid_config"))
            return
        body = {
            **change.as_dict(),
            "backends": [b.node_id for b in self.backends],
            "restart_needed": later,
        }
        await send_json(send, 200, orjson.dumps(body))

    def _apply_push(self, body: bytes) -> int:
        """Validate every sample first (all or nothing), then feed them to the policy."""
        known = {b.node_id for b in self.backends}
        try:
            samples = parse_push(body, self.clock.now())
        except PushValidationError as exc:
            raise GatewayError(
                400, f"Invalid pushed sample: {exc}", "invalid_signal", param=exc.param
            ) from None
        unknown = sorted({node_id for node_id, _ in samples} - known)
        if unknown:
            raise GatewayError(
                400, f"Unknown node id(s): {', '.join(unknown)}.", "unknown_node", param="node"
            )
        sink = self.admission if self.cluster is None else self.cluster.sink  # shared with peers
        for node_id, sample in samples:
            sink.observe(node_id, sample)
        return len(samples)

    def _draining(self) -> bool:
        """True once shutdown began: dashboard event streams end so they never delay it."""
        return not self.relay.accepting

    def _merge_dashboard(self) -> None:
        routes = dashboard.routes(self.state, closing=self._draining, history=self.history)
        for key, app in routes.items():
            self.routes.setdefault(key, app)


class ReloadUnavailable(RuntimeError):
    """The gateway has no configuration to re-read (built in code, not by `kvgate serve`)."""


async def _quiet(coro: Awaitable[Any]) -> Any:
    """A background task's failure is logged, never allowed to tear down the gateway."""
    try:
        return await coro
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("background task failed")
        return None
