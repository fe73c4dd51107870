"""The real-engine prefix benchmark's parts that need no engine
(benchmarks/prefix_routing/real.py): its round-robin proxy passes requests through
untouched and in turn, and kvgate's access lines are read into where requests went."""

from __future__ import annotations

import asyncio

import bench_scripts
import httpx
from aiohttp import web

from kvgate.procs.ports import free_port

real = bench_scripts.load("prefix_routing/real.py")


async def _upstream(name: str) -> tuple[web.AppRunner, str]:
    """An upstream that answers with what it received, the body in two streamed chunks."""

    async def echo(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        response = web.StreamResponse(headers={"x-upstream": name, "x-seen": request.path_qs})
        response.headers["x-auth"] = request.headers.get("authorization", "")
        await response.prepare(request)
        await response.write(b"data: " + body + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", echo)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def test_round_robin_proxy_alternates_and_passes_requests_through() -> None:
    (a_runner, a_url), (b_runner, b_url) = await asyncio.gather(_upstream("a"), _upstream("b"))
    proxy = real.RoundRobinProxy([a_url, b_url])
    port = free_port()
    await proxy.start(port)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            seen = []
            for i in range(4):
                body = f'{{"prompt": "{i}"}}'
                response = await client.post(
                    "/v1/completions?x=1",
                    content=body.encode(),
                    headers={"authorization": "Bearer k"},
                )
                assert response.status_code == 200
                assert response.text == f"data: {body}\n\ndata: [DONE]\n\n"
                assert response.headers["x-seen"] == "/v1/completions?x=1"
                assert response.headers["x-auth"] == "Bearer k"
                seen.append(response.headers["x-upstream"])
        assert seen == ["a", "b", "a", "b"]
        assert proxy.sent == {a_url: 2, b_url: 2}
    finally:
        await proxy.close()
        await a_runner.cleanup()
        await b_runner.cleanup()


def test_access_lines_give_where_requests_went_and_why() -> None:
    log = "\n".join(
        [
            "2026-12-02 07:03:49,254 INFO kvgate.serve: kvgate listening on http://127.0.0.1:1",
            '2026-12-02 07:04:01,968 INFO kvgate.access: {"id":"1","route":"/v1/completions",'
            '"backend":"127.0.0.1:1001","placement":"prefix 0/1100","queue_s":null}',
            '2026-12-02 07:04:02,244 INFO kvgate.access: {"id":"2","route":"/v1/completions",'
            '"backend":"127.0.0.1:1002","placement":"prefix 992/1100","queue_s":0.5}',
            '2026-12-02 07:04:02,245 INFO kvgate.access: {"id":"3","route":"/v1/completions",'
            '"backend":"127.0.0.1:1002","placement":"headroom","queue_s":1.0}',
            '2026-12-02 07:04:02,246 INFO kvgate.access: {"id":"4","route":"/v1/models",'
            '"backend":"-","placement":null,"queue_s":null}',
        ]
    )
    records = real.access_records(log)
    assert [r["id"] for r in records] == ["1", "2", "3", "4"]
    summary = real.placements(records, {":1001": "A", ":1002": "B"})
    assert summary["requests"] == {"A": 1, "B": 2}
    assert summary["by"] == {"uncached": 1, "cached": 1, "headroom": 1}
    assert summary["predicted_cached"] == 992 / 2200
    assert summary["mean_queue_s"] == 0.5
