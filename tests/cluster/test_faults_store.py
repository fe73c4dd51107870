"""A store that is wrong, absent or stalled, with real `kvgate serve` processes and a real
redis-server.

- a store URL kvgate cannot use is refused when the configuration is read (exit 2);
- a store configured and never reached (wrong or missing password, not a Redis server,
  TLS against a plain server, no such database, refused, unknown host): the replica
  answers `/readyz` 503 and every request 503 `store_unreachable`, and its log names the
  problem at ERROR; three such replicas in front of an engine admit nothing; a replica
  started while the store is down admits once it is back;
- the store stalled for 1.2 s: a replica that owns no engine polls them itself before
  their shared samples go stale (samples taken during the stall), and nothing is refused
  503;
- replicas whose watermarks differ warn of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgate.procs.redis_server import RedisServer
from kvgate.testing import FakeEngine, free_port

from .helpers import (
    CLIENT_TIMEOUT_S,
    Replica,
    SimEngines,
    completion,
    count,
    on_sim_engines,
    replicas,
    state,
    wait_for,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.redis_server]


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("redis://127.0.0.1:6379/abc", "database 'abc'"),
        ("redis://127.0.0.1:notaport/0", "port is not a number"),
    ],
)
async def test_a_store_url_kvgate_cannot_use_is_refused_as_it_starts(url: str, said: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvgate", "serve", "--store", url, "--port", str(free_port()),
        "--backend", "http://127.0.0.1:9", env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, stderr = await asyncio.wait_for(process.communicate(), 30)
    text = stderr.decode()
    assert process.returncode == 2, text
    assert said in text and "Traceback" not in text, text


async def _not_redis(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A server of another protocol on the store's port."""
    with contextlib.suppress(OSError):
        await reader.read(1024)
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
    writer.close()


async def _refusals(gw: Replica) -> tuple[int, dict[str, Any], int, str]:
    """/readyz's status and body, and a completion's status and reason."""
    async with httpx.AsyncClient(base_url=gw.url, timeout=CLIENT_TIMEOUT_S) as client:
        ready = await client.get("/readyz")
        body = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}
        answer = await client.post("/v1/completions", json=body)
    reason = answer.headers.get("x-kvgate-reason", "")
    return ready.status_code, ready.json(), answer.status_code, reason


async def test_a_store_never_reached_fails_closed_and_the_log_says_why(
    fake_engine: FakeEngine, tmp_path: Path
) -> None:
    other = await asyncio.start_server(_not_redis, "127.0.0.1", 0)
    other_port = other.sockets[0].getsockname()[1]
    with RedisServer.start(port=0, password="right-password-123") as server:
        good = f"127.0.0.1:{server.port}"
        cases = {
            "wrong password": (
                f"redis://:wrong-password@{good}/0",
                "authentication failed: the server refused",
            ),
            "no password": (f"redis://{good}/0", "wants a password and the URL has none"),
            "not redis": (f"redis://127.0.0.1:{other_port}/0", "not a Redis server"),
            "tls to plain": (f"rediss://:right-password-123@{good}/0", "TLS mismatch"),
            "db 99": (f"redis://:right-password-123@{good}/99", "no such database"),
            "refused": (f"redis://127.0.0.1:{free_port()}/0", "connection refused"),
            "unknown host": ("redis://no-such-host.invalid:6379/0", "unknown host"),
        }
        async with contextlib.AsyncExitStack() as stack:
            served: dict[str, Replica] = {}
            for name, (url, _) in cases.items():
                logs = tmp_path / name.replace(" ", "-")
                started = replicas(1, url, [fake_engine], logs=logs, ready=False)
                (served[name],) = await stack.enter_async_context(started)

            async def all_said() -> bool:  # each has tried its store and logged why
                return all(said in served[n].logged() for n, (_, said) in cases.items())

            assert await wait_for(all_said, 20.0), {
                n: gw.logged()[-500:] for n, gw in served.items()
            }
            answers = {name: await _refusals(gw) for name, gw in served.items()}
            logs = {name: gw.logged() for name, gw in served.items()}
    other.close()
    for name, (_, said) in cases.items():
        ready, body, status, reason = answers[name]
        assert (ready, status, reason) == (503, 503, "store_unreachable"), (name, answers[name])
        assert said in body["store"], (name, body)
        errors = [line for line in logs[name].splitlines() if "ERROR" in line]
        assert any(said in line for line in errors), (name, logs[name][-2000:])
        assert "right-password-123" not in logs[name] and "wrong-password" not in logs[name]


async def test_replicas_with_a_wrong_password_admit_nothing(tmp_path: Path) -> None:
    with RedisServer.start(port=0, password="right-password-123") as server:
        url = f"redis://:wrong-password@127.0.0.1:{server.port}/0"
        async with (
            SimEngines(1) as engines,
            replicas(3, url, engines.urls, ready=False) as served,
        ):
            statuses = await asyncio.gather(
                *(completion(gw, 500, 1000, within=30.0) for gw in served for _ in range(6))
            )
            engines.watching = False
    assert statuses == [503] * 18
    assert engines.peak <= 0.92 and engines.preemptions == 0


async def test_a_replica_started_while_the_store_is_down_admits_once_it_is_back(
    fake_engine: FakeEngine, tmp_path: Path
) -> None:
    port = free_port()
    async with replicas(1, f"redis://127.0.0.1:{port}/0", [fake_engine], ready=False) as (gw,):
        _, _, status, reason = await _refusals(gw)
        assert (status, reason) == (503, "store_unreachable")
        with RedisServer.start(port=port):
            async with httpx.AsyncClient(base_url=gw.url, timeout=CLIENT_TIMEOUT_S) as client:

                async def ready() -> bool:
                    return (await client.get("/readyz")).status_code == 200

                assert await wait_for(ready, 15.0)
                body = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}
                assert (await client.post("/v1/completions", json=body)).status_code == 200


async def test_a_store_stall_leaves_the_engines_live_and_refuses_nothing(
    redis: RedisServer,
) -> None:
    async with on_sim_engines(3, redis.url, 2, time_scale=2.0) as (_, served):
        states = [await state(gw) for gw in served]
        owners = set(states[0]["cluster"]["shards"].values())
        idle = [
            gw
            for gw, s in zip(served, states, strict=True)
            if s["cluster"]["member_id"] not in owners
        ]
        assert idle, "every replica owns an engine"  # 3 replicas, 2 engines: one owns none
        gw = idle[0]
        # Clients one after another, each request 1,316 tokens at its end: two fit an
        # engine at once; those that do not wait in the queue.
        statuses: list[int] = []
        stop = asyncio.Event()

        async def client() -> None:
            while not stop.is_set():
                statuses.append(await completion(gw, 1000, 300, within=60.0))

        clients = [asyncio.create_task(client()) for _ in range(6)]
        await asyncio.sleep(1.0)
        stale: list[tuple[float, str, str]] = []
        ages: dict[str, float] = {}  # each engine's sample age at the stall's end
        took: list[float] = []  # how long each /admin/state took meanwhile
        assert redis.process.pid is not None
        os.kill(redis.process.pid, signal.SIGSTOP)
        stalled_at = time.monotonic()
        try:
            while time.monotonic() - stalled_at < 1.2:
                asked = time.monotonic()
                nodes = (await state(gw))["policy"]["nodes"]
                answered = time.monotonic()
                took.append(round(answered - asked, 3))
                ages = {node: info["age_s"] for node, info in nodes.items()}
                # Live: fresh, or lagging (its page is late, the engine serves): admitted
                # to on its last sample. Else its requests wait for the next sample.
                stale += [
                    (time.monotonic() - stalled_at, node, info["state"])
                    for node, info in nodes.items()
                    if not info["live"]
                ]
                await asyncio.sleep(0.05)
        finally:
            os.kill(redis.process.pid, signal.SIGCONT)
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*clients), 60)
        queue = (await state(gw))["policy"]["queue"]["counters"]
    print(
        f"through a 1.2 s stall: {count(statuses)}, queue {queue}, ages at its end {ages},"
        f" seen neither fresh nor lagging: {stale}, /admin/state took {took} s"
    )
    # Sampled during the stall, by this replica itself: no shared sample arrived meanwhile.
    # (Whether each sample comes before the last one is 1 s old depends on how fast this
    # process, which runs the engines, answers their pages: not asserted.)
    assert all(age < answered - stalled_at for age in ages.values()), (answered - stalled_at, ages)
    assert set(statuses) <= {200, 429}, count(statuses)  # never 503: the engines are healthy
    assert statuses.count(200) >= 6, count(statuses)


async def test_replicas_whose_watermarks_differ_say_so(
    redis: RedisServer, fake_engine: FakeEngine, tmp_path: Path
) -> None:
    async with (
        replicas(1, redis.url, [fake_engine], logs=tmp_path / "a") as (a,),
        replicas(
            1,
            redis.url,
            [fake_engine],
            logs=tmp_path / "b",
            env={"KVGATE_ADMISSION__HIGH_WATERMARK": "0.7"},
        ) as (b,),
    ):

        async def warned() -> bool:
            return "high_watermark=0.7" in a.logged() and "high_watermark=0.7" in b.logged()

        assert await wait_for(warned, 15.0), (a.logged()[-1000:], b.logged()[-1000:])
