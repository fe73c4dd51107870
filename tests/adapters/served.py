"""Fake engines over real HTTP: an aiohttp app served on a free loopback port."""

from __future__ import annotations

from aiohttp import web


async def serve_app(app: web.Application) -> tuple[web.AppRunner, str]:
    """Start `app` on 127.0.0.1 (a free port); returns its runner (to clean up) and URL."""
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"
