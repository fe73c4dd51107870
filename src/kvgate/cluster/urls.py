"""Store URLs: which ones kvgate accepts, and how they are shown (never with a password).

Kept apart from the Redis client so that reading the configuration does not import it.
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit, urlunsplit

SCHEMES = ("redis", "rediss", "unix")


def redact(url: str) -> str:
    """The URL without its password (for logs and /admin/state), whatever else is wrong
    with it."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    hostport = parts.netloc.rpartition("@")[2]
    netloc = f"{user}:***@{hostport}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def check_url(url: str) -> str:
    """`url` if it names a Redis server kvgate can use, else ValueError saying why: its
    scheme, host, port and database are checked here, at configuration time (the Redis
    client would read a database it cannot parse as 0, and a bad port only once it
    connects)."""
    parts = urlsplit(url)
    shown = redact(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(
            f"store URL must start with {', '.join(s + '://' for s in SCHEMES)}: {shown}"
        )
    query = parse_qs(parts.query)
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError(f"a unix:// store URL needs a socket path: {shown}")
        db = query.get("db", ["0"])[-1]
    else:
        if not parts.hostname:
            raise ValueError(f"store URL has no host: {shown}")
        try:
            parts.port  # noqa: B018 (urlsplit checks the port when it is read)
        except ValueError:
            raise ValueError(f"store URL's port is not a number from 0 to 65535: {shown}") from None
        db = query.get("db", [parts.path.strip("/") or "0"])[-1]
    if not db.isdigit():
        raise ValueError(
            f"store URL names database {db!r}: a database is a number (redis://host:6379/0,"
            f" unix:///path?db=0): {shown}"
        )
    return url
