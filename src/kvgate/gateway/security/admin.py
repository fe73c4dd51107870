"""The admin check: one rule for every route under `/admin/` and `/dashboard`.

The credential is `server.admin_token`, sent as `Authorization: Bearer <token>` or as the
password of HTTP Basic auth with any user name (what a browser prompts for, so the
dashboard and its event stream work with no change to the page). The scheme is read
case-insensitively; the token is compared by its SHA-256 digest with
`hmac.compare_digest`, and never logged.

The rule:

- With `server.admin_token` set, every admin route, views and controls alike, keys or no
  keys, answers a request without that credential 401 `invalid_admin_token`, with a Basic
  challenge (`WWW-Authenticate`) so a browser asks for it.
- Without it, the controls (routes that change the gateway: `POST /admin/reload`,
  `POST /admin/signals`) are closed: 403 with their own code (`reload_disabled`, ...).
  The views (`/admin/state`, `/admin/events`, `/dashboard`) are open exactly when the
  gateway authenticates nobody (no API keys: everything else is open too), and closed
  (403 `admin_disabled`) when it has keys.

`AdminGuard.protect_routes` puts the check in front of every route of the gateway's table
whose path is an admin path; the front door (`auth.py`) lets those paths through to it
without asking for a client key. The routes' own code never checks credentials.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvgate.gateway.http.asgi import ASGIApp, Receive, Scope, Send
from kvgate.gateway.http.errors import GatewayError, send_error

#: Paths that are admin routes: the checks of this module guard every one of them.
ADMIN_PREFIXES = ("/admin/", "/dashboard")


def is_admin_path(path: str) -> bool:
    return path.startswith(ADMIN_PREFIXES)


@dataclass(frozen=True, slots=True)
class AdminAccess:
    """What one admin route is to the check: a view of the gateway, or a control that
    changes it, and what its 403 says while no admin token is set."""

    control: bool
    closed_message: str = "Admin routes are closed"
    closed_code: str = "admin_disabled"


#: Reads the gateway's state: open while nobody is authenticated and no token is set.
VIEW = AdminAccess(control=False)
#: Changes the gateway: always needs the admin token.
CONTROL = AdminAccess(control=True)


def admin_credential(headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
    """The token from a bearer header or from HTTP Basic auth's password, if any."""
    for name, value in headers:
        if name != b"authorization":
            continue
        scheme, _, token = value.partition(b" ")
        scheme = scheme.lower()
        if scheme == b"bearer":
            return token.strip()
        if scheme == b"basic":
            try:
                decoded = base64.b64decode(token.strip(), validate=True)
            except (binascii.Error, ValueError):
                return None
            return decoded.partition(b":")[2]
    return None


class AdminGuard:
    """The admin rule of one gateway (see the module docstring).

    `views_open` says whether the views are open without a token: true when the gateway
    has no API keys. Neither it nor the token changes while the gateway runs (a reload
    cannot switch keys on or off, and a new admin token applies at the next start).
    """

    def __init__(self, admin_token: str | None, *, views_open: bool) -> None:
        self._digest = hashlib.sha256(admin_token.encode()).digest() if admin_token else None
        self._views_open = views_open

    @property
    def has_token(self) -> bool:
        return self._digest is not None

    def check(self, headers: Sequence[tuple[bytes, bytes]], access: AdminAccess = VIEW) -> None:
        """Return when the request may use a route of `access`; raise its 401 or 403."""
        expected = self._digest
        if expected is None:
            if access.control or not self._views_open:
                raise GatewayError(
                    403,
                    f"{access.closed_message}: set server.admin_token.",
                    access.closed_code,
                )
            return
        sent = admin_credential(headers)
        if sent is None or not hmac.compare_digest(hashlib.sha256(sent).digest(), expected):
            raise GatewayError(
                401,
                "A valid admin token is required.",
                "invalid_admin_token",
                headers=[(b"www-authenticate", b'Basic realm="kvgate admin"')],
            )

    def protect(self, app: ASGIApp, access: AdminAccess = VIEW) -> ASGIApp:
        """`app` behind the check: refused requests get the OpenAI-style error."""

        async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
            try:
                self.check(scope["headers"], access)
            except GatewayError as err:
                await send_error(send, err)
                return
            await app(scope, receive, send)

        return guarded

    def protect_routes(
        self,
        routes: Mapping[tuple[str, str], ASGIApp],
        controls: Mapping[str, AdminAccess],
    ) -> dict[tuple[str, str], ASGIApp]:
        """The route table with every admin route behind the check.

        `controls` names the controls by path, with their own 403; any other admin route
        is a view when it is a GET and a control otherwise.
        """
        table = dict(routes)
        for (method, path), app in routes.items():
            if not is_admin_path(path):
                continue
            access = controls.get(path) or (VIEW if method == "GET" else CONTROL)
            table[method, path] = self.protect(app, access)
        return table
