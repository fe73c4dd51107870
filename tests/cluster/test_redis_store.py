"""The Redis store against the real redis-server: one atomic exchange, expiry on the
server's clock, leaving, a server restarted empty, passwords, unix sockets and TLS."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from kvgate.cluster import lua
from kvgate.cluster.redis_store import RedisStore
from kvgate.cluster.store import StoreError
from kvgate.cluster.urls import check_url, redact
from kvgate.procs.redis_server import RedisServer
from kvgate.testing import free_port

pytestmark = pytest.mark.redis_server


async def test_members_see_each_others_views_with_the_store_clock(redis: RedisServer) -> None:
    a, b = RedisStore(redis.url), RedisStore(redis.url)
    try:
        await a.exchange("a", b"view-a", 2.0)
        reply = await b.exchange("b", b"view-b", 2.0)
        assert dict(reply.views) == {"a": b"view-a", "b": b"view-b"}
        assert abs(reply.store_time - time.time()) < 1.0  # same host: same wall clock
        reply = await a.exchange("a", b"view-a2", 2.0)
        assert reply.views["a"] == b"view-a2"
    finally:
        await a.close()
        await b.close()


async def test_a_member_that_stops_beating_expires_on_the_servers_clock(
    redis: RedisServer,
) -> None:
    store = RedisStore(redis.url)
    try:
        await store.exchange("short", b"x", 0.2)
        assert set((await store.exchange("long", b"y", 5.0)).views) == {"short", "long"}
        await asyncio.sleep(0.3)
        assert set((await store.exchange("long", b"y", 5.0)).views) == {"long"}
        await store.leave("long")
        assert set((await store.exchange("other", b"z", 0.2)).views) == {"other"}
        await asyncio.sleep(0.3)  # the last member's beat lapses: the keys are gone too
        client = RedisStore(redis.url)._client
        assert await client.exists(lua.MEMBERS_KEY, lua.VIEWS_KEY) == 0
        await client.aclose()
    finally:
        await store.close()


async def test_a_server_restarted_empty_is_used_again_without_a_new_client() -> None:
    port = free_port()
    server = RedisServer.start(port=port)
    store = RedisStore(server.url)
    try:
        await store.exchange("a", b"1", 2.0)
        server.kill()
        with pytest.raises(StoreError):
            await store.exchange("a", b"1", 2.0)
        server = RedisServer.start(port=port)  # empty: no members, no script
        reply = None
        for _ in range(50):
            try:
                reply = await store.exchange("a", b"2", 2.0)
                break
            except StoreError:
                await asyncio.sleep(0.05)
        assert reply is not None and dict(reply.views) == {"a": b"2"}
    finally:
        await store.close()
        server.stop()


async def test_password_unix_socket_and_a_wrong_password() -> None:
    with RedisServer.start(port=None, password="correct-horse-battery") as server:
        assert server.url.startswith("unix://")
        store = RedisStore(server.url)
        try:
            assert set((await store.exchange("a", b"1", 2.0)).views) == {"a"}
            assert "correct-horse" not in store.describe()
        finally:
            await store.close()
        wrong = RedisStore(server.url.replace("correct-horse-battery", "wrong-password-here"))
        try:
            with pytest.raises(StoreError) as failed:
                await wrong.exchange("a", b"1", 2.0)
            assert "wrong-password" not in str(failed.value)
        finally:
            await wrong.close()


async def test_rediss_with_a_private_ca(self_signed: tuple[Path, Path]) -> None:
    cert, key = self_signed
    tls_port = free_port()
    tls = ("--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
           "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no")  # fmt: skip
    with RedisServer.start(port=0, password="tls-password-1234", extra_args=tls):
        url = f"rediss://:tls-password-1234@127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}"
        store = RedisStore(url)
        try:
            assert set((await store.exchange("a", b"1", 2.0)).views) == {"a"}
        finally:
            await store.close()
        unverified = RedisStore(f"rediss://:tls-password-1234@127.0.0.1:{tls_port}/0")
        try:
            with pytest.raises(StoreError):  # a certificate nobody vouches for is refused
                await unverified.exchange("a", b"1", 2.0)
        finally:
            await unverified.close()


def test_urls_are_checked_and_redacted() -> None:
    assert check_url("redis://h:6379/0") and check_url("unix:///run/redis.sock?db=1")
    assert check_url("redis://h") and check_url("redis://h:6379/15?db=15")
    for bad in ("http://h:6379", "redis://", "unix://", "h:6379"):
        with pytest.raises(ValueError):
            check_url(bad)
    for bad, said in [
        ("redis://h:6379/abc", "database 'abc'"),
        ("redis://:pw@h:6379/0?db=x", "database 'x'"),
        ("unix:///run/redis.sock?db=two", "database 'two'"),
        ("redis://:s3cret@h:notaport/0", "port is not a number"),
        ("redis://h:99999/0", "port is not a number"),
    ]:
        with pytest.raises(ValueError, match=said) as raised:
            check_url(bad)
        assert "s3cret" not in str(raised.value)
    assert redact("redis://:s3cret@h:notaport/0") == "redis://:***@h:notaport/0"
    assert redact("rediss://:s3cret@h:6380/2") == "rediss://:***@h:6380/2"
    assert redact("redis://user:s3cret@h/0") == "redis://user:***@h/0"
    assert redact("redis://h:6379/0") == "redis://h:6379/0"
