"""The ASGI types every shell module speaks, defined once.

kvgate is a raw ASGI application (no framework on the hot path), so these are the whole
contract between the servers, the routes and the relay. They are aliases, not protocols:
uvicorn and hypercorn hand over plain dicts and coroutine functions.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Where the front door leaves the authenticated tenant in the ASGI scope (the relay reads it).
TENANT_SCOPE_KEY = "kvgate.tenant"
