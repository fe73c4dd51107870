"""Fault injection for soak tests: simulated engines that crash, restart, hang and reset.

A `ChaosNode` is one simulated vLLM engine (`kvgate.sim.server.SimServer`, untouched)
behind two front doors that the gateway is pointed at instead of the engine itself:

- an **API proxy**, a byte-level TCP relay in front of the engine's OpenAI port, which can
  *crash* (every open connection reset with RST, the port closed: connection refused),
  *restart* (the port listens again; the engine behind it aborted everything it was
  doing when its connections closed, as a restarted engine would have lost it),
  *reset* chosen connections (RST mid-request or mid-stream) and *stall* them (bytes stop
  flowing to the gateway while the connection stays open: an engine hung mid-stream);
- a **metrics front**, a tiny HTTP server on its own port serving the engine's real
  Prometheus page (`backends[].metrics_url` points there), which can *hang* (accept the
  scrape, never answer), answer *garbage* (random bytes with status 200), answer *500*,
  or be down together with the API port.

`ChaosMonkey` injects those faults at random (seeded) and counts them, so a soak test can
report exactly how many faults of each kind the gateway lived through. Nothing here knows
about the gateway: it only makes engines misbehave the way real ones and networks do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import struct
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvgate.sim.model.engine import Engine, EngineConfig
from kvgate.sim.server import SimServer

log = logging.getLogger(__name__)

MetricsMode = Literal["ok", "hang", "garbage", "error"]
_MAX_HEAD = 16 * 1024
_COPY_CHUNK = 64 * 1024


def _rst(writer: asyncio.StreamWriter) -> None:
    """Close the connection with a TCP reset (SO_LINGER 0), as a crashed peer does."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass(eq=False)
class _Link:
    """One proxied connection: gateway side and engine side."""

    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter
    stalled: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def reset(self) -> None:
        _rst(self.client)
        self.upstream.transport.abort()
        self.done.set()

    def close(self) -> None:
        for writer in (self.client, self.upstream):
            with contextlib.suppress(Exception):
                writer.close()
        self.done.set()


class ChaosNode:
    """One simulated engine behind a fault-injecting API proxy and metrics front."""

    def __init__(
        self, config: EngineConfig, *, seed: int = 0, model_name: str = "sim-llama"
    ) -> None:
        self.sim = SimServer(Engine(config, seed=seed), model_name=model_name)
        self.host = "127.0.0.1"
        self.api_port = 0
        self.metrics_port = 0
        self.metrics_mode: MetricsMode = "ok"
        self.down = False
        self._sim_port = 0
        self._api: asyncio.Server | None = None
        self._metrics: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._rng = random.Random(seed)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.api_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def open_links(self) -> int:
        return len(self._links)

    async def start(self) -> ChaosNode:
        self._sim_port = await self.sim.start(self.host, 0)
        await self._listen()
        return self

    async def close(self) -> None:
        await self._unlisten()
        for link in list(self._links):
            link.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self.sim.close()

    # ---- faults ---------------------------------------------------------------------------

    async def crash(self) -> int:
        """Reset every open connection and stop listening; returns connections reset."""
        self.down = True
        await self._unlisten()
        links = list(self._links)
        for link in links:
            link.reset()
        return len(links)

    async def restart(self) -> bool:
        """Listen again on the same ports; False if a port was taken meanwhile."""
        try:
            await self._listen()
        except OSError as exc:
            log.warning("chaos: %s could not restart: %s", self.url, exc)
            return False
        self.down = False
        return True

    def reset_some(self, count: int) -> int:
        """Reset up to `count` random open connections with RST."""
        chosen = self._pick(count)
        for link in chosen:
            link.reset()
        return len(chosen)

    def stall_some(self, count: int) -> int:
        """Stop relaying engine bytes on up to `count` random connections (they hang)."""
        chosen = [link for link in self._pick(count * 2) if not link.stalled][:count]
        for link in chosen:
            link.stalled = True
        return len(chosen)

    def _pick(self, count: int) -> list[_Link]:
        links = list(self._links)
        self._rng.shuffle(links)
        return links[:count]

    # ---- listeners ------------------------------------------------------------------------

    async def _listen(self) -> None:
        api = await asyncio.start_server(self._proxy, self.host, self.api_port, backlog=1024)
        try:
            metrics = await asyncio.start_server(self._serve_metrics, self.host, self.metrics_port)
        except OSError:
            api.close()
            raise
        self._api, self._metrics = api, metrics
        self.api_port = api.sockets[0].getsockname()[1]
        self.metrics_port = metrics.sockets[0].getsockname()[1]

    async def _unlisten(self) -> None:
        for server in (self._api, self._metrics):
            if server is not None:
                server.close()
        self._api = self._metrics = None

    def _track(self) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    # ---- API proxy ------------------------------------------------------------------------

    async def _proxy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._track()
        if self.down:
            _rst(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self._sim_port)
        except OSError:
            _rst(writer)
            return
        link = _Link(writer, up_writer)
        self._links.add(link)
        try:
            await asyncio.gather(
                self._copy(reader, up_writer, link, downstream=False),
                self._copy(up_reader, writer, link, downstream=True),
            )
        finally:
            self._links.discard(link)
            link.close()

    @staticmethod
    async def _copy(
        src: asyncio.StreamReader, dst: asyncio.StreamWriter, link: _Link, *, downstream: bool
    ) -> None:
        try:
            while not link.done.is_set():
                data = await src.read(_COPY_CHUNK)
                if not data:
                    break
                if downstream and link.stalled:
                    await link.done.wait()  # hold the connection open, send nothing more
                    break
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            pass
        finally:
            link.close()

    # ---- metrics front ----------------------------------------------------------------------

    async def _serve_metrics(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self._track()
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                    return
                if len(head) > _MAX_HEAD or self.down:
                    return
                mode = self.metrics_mode
                if mode == "hang":
                    await reader.read()  # until the scraper gives up and closes
                    return
                if mode == "garbage":
                    body, status = self._rng.randbytes(self._rng.randint(1, 2048)), 200
                elif mode == "error":
                    body, status = b"internal error", 500
                else:
                    body, status = self.sim.metrics.render().encode(), 200
                writer.write(
                    b"HTTP/1.1 %d X\r\ncontent-type: text/plain; version=0.0.4\r\n"
                    b"content-length: %d\r\n\r\n%s" % (status, len(body), body)
                )
                await writer.drain()
        except (ConnectionError, OSError):
            return
        finally:
            writer.close()


# ---- the monkey --------------------------------------------------------------------------------

FAULTS = ("crash", "metrics_hang", "metrics_garbage", "metrics_error", "reset", "stall")


@dataclass
class ChaosMonkey:
    """Injects random faults into `nodes` every `mean_interval_s` (exponential gaps).

    A crashed node restarts after 0.3-1.5 s; a metrics fault lasts 0.3-2 s. At most
    `len(nodes) - 1` nodes are down at once, so the cluster as a whole stays reachable
    (the gateway must still route around the missing one). `counts` says what was done.
    """

    nodes: Sequence[ChaosNode]
    seed: int = 0
    mean_interval_s: float = 0.25
    faults: Sequence[str] = FAULTS
    counts: Counter[str] = field(default_factory=Counter)

    async def run(self, duration_s: float) -> Counter[str]:
        """Inject faults for `duration_s`, then heal every node; returns the counts."""
        rng = random.Random(self.seed)
        pending: set[asyncio.Task[None]] = set()
        loop = asyncio.get_running_loop()
        end = loop.time() + duration_s
        try:
            while (left := end - loop.time()) > 0:
                await asyncio.sleep(min(left, rng.expovariate(1.0 / self.mean_interval_s)))
                if loop.time() >= end:
                    break
                task = self._inject(rng)
                if task is not None:
                    pending.add(task)
                    task.add_done_callback(pending.discard)
        finally:
            for task in list(pending):
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await self.heal()
        return self.counts

    async def heal(self) -> None:
        """Every node up, every metrics page honest."""
        for node in self.nodes:
            node.metrics_mode = "ok"
            if node.down:
                await node.restart()

    def _inject(self, rng: random.Random) -> asyncio.Task[None] | None:
        node = rng.choice(list(self.nodes))
        fault = rng.choice(list(self.faults))
        if fault == "crash":
            up = sum(1 for n in self.nodes if not n.down)
            if node.down or up <= 1:
                return None
            self.counts["crash"] += 1
            return asyncio.create_task(self._crash(node, rng.uniform(0.3, 1.5)))
        if fault.startswith("metrics_"):
            if node.metrics_mode != "ok" or node.down:
                return None
            self.counts[fault] += 1
            mode: MetricsMode = fault.removeprefix("metrics_")  # type: ignore[assignment]
            return asyncio.create_task(self._metrics(node, mode, rng.uniform(0.3, 2.0)))
        done = node.reset_some(rng.randint(1, 3)) if fault == "reset" else node.stall_some(1)
        self.counts[f"{fault}_connections"] += done
        return None

    async def _crash(self, node: ChaosNode, down_for: float) -> None:
        self.counts["connections_reset_by_crash"] += await node.crash()
        try:
            await asyncio.sleep(down_for)
        finally:
            if await node.restart():
                self.counts["restart"] += 1

    @staticmethod
    async def _metrics(node: ChaosNode, mode: MetricsMode, lasting: float) -> None:
        node.metrics_mode = mode
        try:
            await asyncio.sleep(lasting)
        finally:
            node.metrics_mode = "ok"
