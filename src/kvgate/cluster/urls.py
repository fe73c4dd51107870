"""Store URLs: which ones kvgate accepts, and how they are shown (never with a password).

Kept apart from the Redis client so that reading the configuration does not import it.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

SCHEMES = ("redis", "rediss", "unix")


def redact(url: str) -> str:
    """The URL without its password (for logs and /admin/state)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    netloc = f"{user}:***@{host}{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def check_url(url: str) -> str:
    """`url` if it names a Redis server kvgate can use, else ValueError saying why."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(
            f"store URL must start with {', '.join(s + '://' for s in SCHEMES)}: {redact(url)}"
        )
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError(f"a unix:// store URL needs a socket path: {redact(url)}")
    elif not parts.hostname:
        raise ValueError(f"store URL has no host: {redact(url)}")
    return url
